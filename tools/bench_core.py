"""The harness of ``tools/bench.py``: constants, timing plumbing and the
:class:`Bench` run state (work directory, workloads, result rows, the real
``VllmConfig`` and connectors). The sections live in ``bench_io`` (floor,
save, hit, write) and ``bench_scale`` (contains, footprint, mixed)."""

from __future__ import annotations

import argparse
import gc
import hashlib
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent

import bench_report as report  # noqa: E402
import torch  # noqa: E402

HIDDEN = 3584
DTYPE = torch.bfloat16
ROW_BYTES = HIDDEN * 2
GiB = 1 << 30
MiB = 1 << 20

FULL_WORKLOADS = [("1MB", 140), ("34.3MB", 4785), ("130.8MB", 18248)]
QUICK_WORKLOADS = [("1MB", 140), ("8MB", 1116)]
ALL_SECTIONS = ["floor", "save", "hit", "write", "contains", "footprint", "mixed",
                "burst", "producer", "loadread", "sched"]


# ---------------------------------------------------------------------------
# plumbing
# ---------------------------------------------------------------------------
def now_ns() -> int:
    return time.perf_counter_ns()


#: Where encoder outputs live (``--device``): saves copy off it, loads land on it.
DEVICE = torch.device("cpu")


def sync_device() -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` takes, including the device work it queued (and none
    queued before: the device is synchronized before the clock starts too)."""
    sync_device()
    t0 = time.perf_counter_ns()
    fn()
    sync_device()
    return (time.perf_counter_ns() - t0) * 1e-9


#: The sections a ``--device cuda`` run measures (its default): those whose
#: tensors live on the device. The others time lookups, disk footprint,
#: durable writes of CPU tensors and the scheduler thread: nothing on a GPU.
GPU_SECTIONS = ["floor", "save", "hit", "producer", "loadread"]


def device_sections(device: torch.device, sections: str | None) -> list[str]:
    """The sections to run on ``device`` for ``--sections`` (None: not given):
    every section on the CPU, :data:`GPU_SECTIONS` on a GPU. ValueError with a
    clear message for a section a GPU run cannot measure."""
    if sections is None:
        return list(GPU_SECTIONS if device.type == "cuda" else ALL_SECTIONS)
    wanted = [s.strip() for s in sections.split(",") if s.strip()]
    if device.type == "cuda":
        other = [s for s in wanted if s not in GPU_SECTIONS]
        if other:
            raise ValueError(f"--device {device.type} measures the sections {','.join(GPU_SECTIONS)} only, "
                             f"not {','.join(other)} (they involve no tensor on the device: run them "
                             f"with --device cpu)")
    return wanted


def check_device(name: str) -> torch.device:
    """The ``--device`` as a torch device; ValueError with a clear message
    when it is not usable here."""
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name}: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available here "
                             f"(torch {torch.__version__}, torch.version.cuda={torch.version.cuda}, "
                             f"torch.cuda.is_available() is False); run on a machine with an NVIDIA GPU "
                             f"and a CUDA build of torch, or use --device cpu")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"--device {name}: only cpu and cuda are supported")
    return dev


def ids(prefix: str, count: int, start: int = 0) -> list[str]:
    """vLLM-like mm identifiers: 64 hex digits, deterministic per (prefix, i)."""
    return [hashlib.blake2b(f"{prefix}:{i}".encode(), digest_size=32).hexdigest()
            for i in range(start, start + count)]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick = args.quick
        self.workloads = QUICK_WORKLOADS if self.quick else FULL_WORKLOADS
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.load_samples: list[tuple[float, float, float]] = []
        self.work = tempfile.mkdtemp(prefix="ecstore-bench-", dir=args.workdir)
        self._n = 0
        self.salt = f"{os.getpid()}-{time.time_ns()}"
        max_rows = max(n for _, n in self.workloads)
        if "mixed" in args.sections or "footprint" in args.sections:
            max_rows = max(max_rows, 4785 if not self.quick else 1116)
        g = torch.Generator().manual_seed(0)
        self.base = torch.randn(max_rows, HIDDEN, generator=g, dtype=torch.float32).to(DTYPE)
        self.device = DEVICE
        #: The encoder outputs on the device (on a GPU: where vLLM's encoder writes them).
        self.base_dev = self.base if DEVICE.type == "cpu" else self.base.to(DEVICE)
        self.vcfg = None
        self.model = None
        self._image_feature = None  # image_request's template (vLLM's own processing, once)

    # -- bookkeeping -----------------------------------------------------------
    def sample_load(self) -> None:
        self.load_samples.append(os.getloadavg())

    def dir(self, name: str) -> str:
        self._n += 1
        d = os.path.join(self.work, f"{self._n:03d}-{name}")
        os.makedirs(d, exist_ok=True)
        return d

    def rm(self, d: str) -> None:
        shutil.rmtree(d, ignore_errors=True)

    def settle(self) -> None:
        """Between timed repetitions (untimed): write back dirty pages so one
        repetition's writeback does not land in the next one's timing. Skipped
        in --quick (CI only checks that numbers come out)."""
        if not self.quick:
            os.sync()

    def ids(self, prefix: str, count: int) -> list[str]:
        return ids(f"{self.salt}:{prefix}", count)

    def reps(self, nbytes: int) -> int:
        if self.args.reps:
            return self.args.reps
        if self.quick:
            return 2
        if self.on_gpu:  # fewer: a GPU run aims at five minutes (docs/benchmarks.md; not measured yet)
            return 5 if nbytes >= 100e6 else 7 if nbytes >= 20e6 else 11
        if nbytes >= 100e6:
            return 7
        if nbytes >= 20e6:
            return 11
        return 21

    def add(self, section: str, system: str, samples: list[float], *, unit: str = "s",
            workload: str = "", **extra: Any) -> dict:
        samples = [float(x) for x in samples if x is not None and math.isfinite(float(x))]
        row = {"section": section, "workload": workload, "system": system, "unit": unit}
        if samples:
            row.update(report.summarize(samples))
        else:
            row.update({"median": None, "p10": None, "p90": None, "p99": None, "min": None, "max": None,
                        "n": 0})
        row.update(extra)
        if row.get("resident_after_drop_bytes") is not None:
            row["note"] = (row.get("note", "") + f"; page-cache residency after the drop ≤ "
                           f"{row['resident_after_drop_bytes'] / 1024:.0f} KiB (fincore)")
        self.rows.append(row)
        med = row["median"]
        shown = report.fmt_value(med, unit) if unit != "s" else report.fmt_time(med)
        log(f"  {section:9s} {workload:8s} {system:45s} {shown}  (n={row['n']})")
        return row

    def tensor(self, n: int) -> torch.Tensor:
        """The first ``n`` rows, on the CPU."""
        return self.base[:n]

    def dev_tensor(self, n: int) -> torch.Tensor:
        """The first ``n`` rows on ``--device`` (an encoder output to save)."""
        return self.base_dev[:n]

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    # -- vLLM ------------------------------------------------------------------
    def vllm_config(self):
        if self.vcfg is None:
            t0 = time.time()
            self.vcfg = tiny_vllm_config(self.args.model_dir)
            self.model = self.vcfg.model_config.model
            assert self.vcfg.model_config.dtype == DTYPE, self.vcfg.model_config.dtype
            log(f"VllmConfig for {self.model} (bf16) built in {time.time() - t0:.1f} s")
            freeze_gc()
        return self.vcfg

    def vllm_config_for(self, ec_role: str):
        """The same tiny model's real ``VllmConfig`` with the connector in
        ``ec_role`` (e.g. ``ec_producer``: an encode-only instance)."""
        if ec_role == "ec_both":
            return self.vllm_config()
        cached = getattr(self, "_vcfg_roles", {})
        if ec_role not in cached:
            self.vllm_config()
            cached[ec_role] = tiny_vllm_config(self.args.model_dir, role=ec_role)
            self._vcfg_roles = cached
            freeze_gc()
        return cached[ec_role]

    def image_request(self, req_id: str, identifier: str, rows: int | None = None):
        """vLLM's real ``Request`` for one image of the tiny BLIP-2 (processed
        once by vLLM's own input processor, then reused) under
        ``identifier``: vLLM holds its pixels, so it can encode the item.
        ``rows``: its placeholder's length instead (the bench's tiny entries
        have fewer rows than an image)."""
        from dataclasses import replace

        from vllm.multimodal.inputs import PlaceholderRange
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        if self._image_feature is None:
            from vllm.renderers.inputs.preprocess import parse_model_prompt
            from vllm.v1.engine.input_processor import InputProcessor

            from ecstore.testing import tiny_model

            ip = InputProcessor(self.vllm_config())
            prompt = {"prompt": tiny_model.prompt(), "multi_modal_data": {"image": tiny_model.make_image(1)}}
            (engine_input,) = ip.renderer.render_cmpl([parse_model_prompt(ip.model_config, prompt)],
                                                      ip.renderer.default_cmpl_tok_params)
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            ecr = ip.process_inputs("template", engine_input, params, ("generate",))
            (self._image_feature,) = Request.from_engine_core_request(ecr, block_hasher=None).mm_features
            freeze_gc()
        feature = self._image_feature
        n = feature.mm_position.length if rows is None else rows
        feature = replace(feature, identifier=identifier, mm_hash=identifier,
                          mm_position=PlaceholderRange(offset=0, length=n))
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        return Request(req_id, [0] * n + [1, 2], params, None, mm_features=[feature])

    def store_connector(self, role_name: str, **extra: Any):
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

        from ecstore.connector import ECStoreConnector

        cfg = self.vllm_config()
        cfg.ec_transfer_config.ec_connector_extra_config = dict(extra)
        return ECStoreConnector(cfg, getattr(ECConnectorRole, role_name))

    def example_connector(self, path: str):
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

        cfg = self.vllm_config()
        cfg.ec_transfer_config.ec_connector_extra_config = {"shared_storage_path": path}
        return ECExampleConnector(cfg, ECConnectorRole.WORKER)

    def store(self, d: str | None, *, disk_bytes: float = 0, cpu_bytes: float = 0, local_cpu: bool = True,
              model: str | None = None):
        from ecstore import ECStore, ECStoreConfig
        from ecstore.config import load_config

        # For A/Bs from the environment: LMCACHE_EC_POOLED_BLOBS=0 (saves into
        # fresh memory), LMCACHE_EC_MIN_FILE_BLOB_SIZE=<MiB> (which blobs go to files),
        # LMCACHE_EC_USE_ODIRECT=0 (blob files through the page cache),
        # LMCACHE_EC_SPARE_BLOB_FILES=0 (no spare blob files).
        ab = load_config(env={k: v for k, v in os.environ.items()
                              if k in ("LMCACHE_EC_POOLED_BLOBS", "LMCACHE_EC_MIN_FILE_BLOB_SIZE",
                                       "LMCACHE_EC_USE_ODIRECT", "LMCACHE_EC_SPARE_BLOB_FILES")})
        cfg = ECStoreConfig(local_disk=d, max_local_disk_size=disk_bytes / GiB if d else 0.0,
                            local_cpu=local_cpu, max_local_cpu_size=(cpu_bytes / GiB) if local_cpu else 0.0,
                            pooled_blobs=ab.pooled_blobs, min_file_blob_size=ab.min_file_blob_size,
                            use_odirect=ab.use_odirect, spare_blob_files=ab.spare_blob_files)
        identity = None
        if self.vcfg is not None and model in (None, self.model):
            # What the connectors of this VllmConfig read and write under.
            from ecstore.connector.vllm_identity import encoder_identity

            identity = encoder_identity(self.vcfg, "bfloat16", None)
        return ECStore(cfg, model=model or self.model or "bench/model", dtype=DTYPE, identity=identity)


def tiny_vllm_config(model_dir: str | Path, role: str = "ec_both", extra: dict | None = None):
    """The real bf16 ``VllmConfig`` vLLM builds for the tiny BLIP-2 (built
    into ``model_dir`` once, then reused) with the ecstore connector in
    ``role``: what the connectors of the bench tools are made from."""
    from vllm.config import ECTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    from ecstore.testing import tiny_model

    built = tiny_model.build_tiny_blip2(model_dir)
    kw = tiny_model.engine_kwargs(
        built, dtype="bfloat16",
        ec_transfer_config=ECTransferConfig(
            ec_connector="ECStoreConnector", ec_role=role,
            ec_connector_module_path="ecstore.connector", ec_connector_extra_config=dict(extra or {})))
    return EngineArgs(**kw).create_engine_config()


def freeze_gc() -> None:
    """Move everything allocated so far (vLLM's and torch's module objects:
    ~0.5 M) out of the collector's reach, so the ``gc.collect()`` run before
    each timed repetition costs microseconds instead of ~0.5 s."""
    gc.collect()
    gc.freeze()


def step_begin(conn) -> None:
    """What the model runner does with a worker connector before a step's
    encoder runs: bind the step's (here empty) metadata. ``save_caches``
    inside a step leaves the write to the step's end."""
    from ecstore.connector.metadata import ECStoreConnectorMetadata

    conn.bind_connector_metadata(ECStoreConnectorMetadata())


def step_end(conn) -> None:
    """The step's end: ``build_connector_worker_meta`` (starts the step's
    writes; an encode-only producer waits for their commit), then clear."""
    conn.build_connector_worker_meta()
    conn.clear_connector_metadata()


def ws_load(conn, identifier: str, n: int) -> torch.Tensor:
    """The ecstore worker connector's load path, as the model runner drives it."""
    from ecstore.connector.metadata import ECStoreConnectorMetadata, LoadSpec

    conn.bind_connector_metadata(ECStoreConnectorMetadata(loads=[LoadSpec("req-0", identifier, n, HIDDEN)]))
    cache: dict[str, torch.Tensor] = {}
    conn.start_load_caches(cache)
    conn.clear_connector_metadata()
    return cache[identifier]

