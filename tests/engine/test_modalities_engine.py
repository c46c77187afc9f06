"""Every modality on the real engine: ``vllm.LLM`` serving the tiny Qwen
models (ecstore.testing.tiny_qwen) with the ecstore connector, single-process
engines (tests/helpers/mm_engine_run.py).

Per model three engine runs share one store: ``reference`` (no connector: what the
language model gets when vLLM computes everything), ``cold`` (empty store:
the encoder runs, ``EC put`` is logged for every item) and ``restart`` (a new
engine on the same store: the cold items are loaded, the encoder does not run
for them, and the embeddings that reach the language model are bit-equal to
the reference run's; a new item misses). To stay in the suite's time budget
all models' reference and cold engines run one after the other in one child
process, and all restart engines in a second one (the restart). Qwen2.5-VL adds an mp4 clip and a
fourth engine that samples the same clip at another fps (server-level
``media_io_kwargs``), which must miss. Omni sends image + audio in one
request, a video with ``use_audio_in_video``, and a request whose image is
cached while its audio is new (a partial hit).

What reaches the language model is recorded by wrapping the model's
``embed_input_ids``; encoder runs by wrapping ``embed_multimodal``.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers.engine_proc import engine_env
from helpers.engine_proc import run_engine as run_engine_process

# The first test pays for both child processes (thirteen engines) in its setup.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "tests" / "helpers" / "mm_engine_run.py"
PUT_RE = re.compile(r"EC put: stored (\d+) bytes for mm_hash=(\w+)")


@dataclass
class MMRun:
    """One engine run: its console, per-request records and summed EC metrics."""

    console: str
    requests: dict[str, dict[str, Any]]
    metrics: dict[str, float]

    @property
    def puts(self) -> set[str]:
        """The identifiers of every ``EC put`` line."""
        return {h for _, h in PUT_RE.findall(self.console)}

    def ids(self, name: str, modality: str | None = None) -> list[str]:
        return [f["identifier"] for f in self.requests[name]["features"] if modality in (None, f["modality"])]

    def embeds(self, name: str) -> list[tuple[int, tuple[int, ...]]]:
        """(xxh3 of the bytes, shape) of each embedding that reached the LM, sorted."""
        return sorted((e["xxh3"], tuple(e["shape"])) for e in self.requests[name]["embeds"])

    def encoded(self, name: str) -> int:
        """How many items the encoder produced for request ``name``."""
        return sum(len(c["shapes"]) for c in self.requests[name]["encoder"])

    def m(self, key: str) -> float:
        return self.metrics.get(key, 0)


def run_engines(work: Path, name: str, runs: list[dict], timeout: float = 900) -> dict[str, MMRun]:
    """Run ``runs`` one after the other in one child process; results by run name."""
    out = work / f"{name}.json"
    cmd = [sys.executable, str(HELPER), "--runs", json.dumps(runs), "--out", str(out)]
    console = run_engine_process(cmd, name, REPO, engine_env(log_stats=True), timeout)
    res = json.loads(out.read_text())
    runs_out: dict[str, MMRun] = {}
    for run in runs:
        part = console.split(f"=== engine run {run['name']} ", 1)[1]
        part = part.split(f"=== end of engine run {run['name']} ", 1)[0]
        r = res[run["name"]]
        for req_name, rec in r["requests"].items():
            assert rec["finish"] == "length", (run["name"], req_name, rec["finish"])
        runs_out[run["name"]] = MMRun(part, r["requests"], r["ec_metrics"])
    return runs_out


def req(name: str, *items: tuple[str, int], **mm_processor_kwargs: Any) -> dict:
    r: dict[str, Any] = {"name": name, "items": [list(i) for i in items]}
    if mm_processor_kwargs:
        r["mm_processor_kwargs"] = mm_processor_kwargs
    return r


# What each model runs: requests of the cold run (repeated on restart) and
# requests only the restart sends (new inputs: misses).
PLAN: dict[str, tuple[list[dict], list[dict]]] = {
    "qwen2_5_vl": ([req("image", ("image", 1)), req("video", ("video", 2)), req("mp4", ("mp4", 3))],
                   [req("new_image", ("image", 4))]),
    "qwen3_vl": ([req("image", ("image", 1)), req("video", ("video", 2))], [req("new_image", ("image", 4))]),
    "qwen2_audio": ([req("audio", ("audio", 1))], [req("new_audio", ("audio", 2))]),
    "qwen2_5_omni": ([req("image_audio", ("image", 1), ("audio", 1)),
                      req("video_with_audio", ("video", 2), ("audio", 2), use_audio_in_video=True)],
                     [req("cached_image_new_audio", ("image", 1), ("audio", 3))]),
}
FPS1 = {"media_io_kwargs": {"video": {"fps": 1}}}  # the mp4 sampled at 1 fps instead of the default 2


@dataclass
class Scenario:
    """One model's runs: ``reference`` (cold + new requests, no connector),
    ``cold`` (empty store), ``restart`` (a new process on the same store:
    new + cold requests)."""

    reference: MMRun
    cold: MMRun
    restart: MMRun
    cold_names: list[str]
    new_names: list[str]


@pytest.fixture(scope="module")
def runs(tiny_qwen2_5_vl_dir, tiny_qwen3_vl_dir, tiny_qwen2_audio_dir, tiny_qwen2_5_omni_dir,
         tmp_path_factory) -> dict[str, MMRun]:
    """Two child processes for all four models: reference and cold engines,
    then (a restart) the restart engines and Qwen2.5-VL's 1-fps engine."""
    work = tmp_path_factory.mktemp("modalities")
    dirs = {"qwen2_5_vl": tiny_qwen2_5_vl_dir, "qwen3_vl": tiny_qwen3_vl_dir, "qwen2_audio": tiny_qwen2_audio_dir,
            "qwen2_5_omni": tiny_qwen2_5_omni_dir}

    def run(tiny: str, kind: str, requests: list[dict], store: bool, **more: Any) -> dict:
        extra = {"local_disk": str(work / f"ec-{tiny}"), "max_local_disk_size": 0.01} if store else None
        return {"name": f"{tiny}-{kind}", "tiny": tiny, "model": str(dirs[tiny]), "requests": requests,
                "extra": extra, **more}

    first = []
    second = []
    for tiny, (cold, new) in PLAN.items():
        first += [run(tiny, "reference", cold + new, store=False), run(tiny, "cold", cold, store=True)]
        # New requests first: vLLM's own encoder cache is empty then, so a cached
        # item in one of them (Omni's image) can only come from the store.
        second.append(run(tiny, "restart", new + cold, store=True))
    second.append(run("qwen2_5_vl", "fps1", [req("mp4", ("mp4", 3))], store=True, engine_kw=FPS1))
    return {**run_engines(work, "reference-and-cold", first), **run_engines(work, "restart", second)}


def scenario(runs: dict[str, MMRun], tiny: str) -> Scenario:
    cold, new = PLAN[tiny]
    return Scenario(runs[f"{tiny}-reference"], runs[f"{tiny}-cold"], runs[f"{tiny}-restart"],
                    [r["name"] for r in cold], [r["name"] for r in new])


def check_cold_then_restart(s: Scenario) -> None:
    """The checks every model shares."""
    cold_ids: set[str] = set()
    for name in s.cold_names:
        ids = s.cold.ids(name)
        assert ids and ids == s.reference.ids(name), name  # content-derived, the same in every engine
        assert s.cold.encoded(name) == len(ids), name      # the encoder ran for every item
        assert s.cold.embeds(name) == s.reference.embeds(name), name
        cold_ids |= set(ids)
    assert s.cold.puts == cold_ids
    assert (s.cold.m("misses"), s.cold.m("saves"), s.cold.m("hits")) == (len(cold_ids), len(cold_ids), 0)

    for name in s.cold_names:  # restart: every cold item loaded, the encoder never ran for it
        assert s.restart.encoded(name) == 0, name
        assert s.restart.embeds(name) == s.reference.embeds(name), name  # bit-equal to no-connector
    new_ids: set[str] = set()
    for name in s.new_names:  # a new input misses: computed, stored, same as the reference
        fresh = set(s.restart.ids(name)) - cold_ids
        assert fresh, name
        assert s.restart.encoded(name) == len(fresh), name
        assert s.restart.embeds(name) == s.reference.embeds(name), name
        new_ids |= fresh
    assert s.restart.puts == new_ids
    assert (s.restart.m("hits"), s.restart.m("loads"), s.restart.m("misses"), s.restart.m("saves")) == (
        len(cold_ids), len(cold_ids), len(new_ids), len(new_ids))
    assert s.restart.m("load_failures") == 0


# --------------------------------------------------------------------------- Qwen2.5-VL
def test_qwen2_5_vl_image_video_mp4_cold_restart_and_a_new_image(runs):
    s = scenario(runs, "qwen2_5_vl")
    check_cold_then_restart(s)
    assert [len(s.reference.ids(n)) for n in ("image", "video", "mp4")] == [1, 1, 1]


def test_qwen2_5_vl_the_same_clip_sampled_at_another_fps_misses(runs):
    s = scenario(runs, "qwen2_5_vl")
    run = runs["qwen2_5_vl-fps1"]
    (ident,) = run.ids("mp4")
    assert ident not in s.cold.puts  # fewer frames: another item
    assert run.encoded("mp4") == 1 and run.puts == {ident} and run.m("misses") == 1
    assert run.embeds("mp4") != s.cold.embeds("mp4")


# --------------------------------------------------------------------------- Qwen3-VL
def test_qwen3_vl_deepstack_cold_restart_and_a_new_image(runs):
    s = scenario(runs, "qwen3_vl")
    check_cold_then_restart(s)
    # deepstack: what is stored and loaded is the 384-wide encoder output, not the LM's 128.
    assert {shape[-1] for _, shape in s.restart.embeds("image")} == {384}


# --------------------------------------------------------------------------- Qwen2-Audio
def test_qwen2_audio_cold_restart_and_a_new_clip(runs):
    check_cold_then_restart(scenario(runs, "qwen2_audio"))


# --------------------------------------------------------------------------- Qwen2.5-Omni thinker
def test_qwen2_5_omni_image_audio_and_video_with_its_audio(runs):
    s = scenario(runs, "qwen2_5_omni")
    check_cold_then_restart(s)
    assert sorted(f["modality"] for f in s.reference.requests["image_audio"]["features"]) == ["audio", "image"]
    assert sorted(f["modality"] for f in s.reference.requests["video_with_audio"]["features"]) == ["audio", "video"]


def test_qwen2_5_omni_partial_hit_loads_the_image_and_computes_the_audio(runs):
    """The restart's first request: its image can only come from the store."""
    s = scenario(runs, "qwen2_5_omni")
    name = "cached_image_new_audio"
    assert next(iter(s.restart.requests)) == name
    assert s.restart.ids(name, "image") == s.cold.ids("image_audio", "image")  # cached
    assert s.restart.ids(name, "audio")[0] not in s.cold.puts                 # new
    assert s.restart.encoded(name) == 1
    (call,) = s.restart.requests[name]["encoder"]
    assert "input_audio_features" in call["inputs"] and not any("pixel" in k for k in call["inputs"])
