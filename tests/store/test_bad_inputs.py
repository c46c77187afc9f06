"""Bad inputs: every odd tensor, identifier and model name gets a documented
outcome, and a refusal leaves the store exactly as it was.

Outcomes:

* ``InvalidEntryError`` -- ``ecstore.InvalidEntryError`` is raised before
  anything is written (for identifiers: by ``get``/``contains``/``delete``
  too);
* ``refused`` -- ``put`` returns False and logs a warning on the ``ecstore``
  logger (the input is valid, it just cannot be cached);
* ``accepted`` -- stored; ``get`` returns it bit-exact (``where`` says which
  tier holds it).

After a refusal the store is unchanged: same entries (keys and
identifiers), same byte total, same memory-tier keys, and -- after
``flush()`` -- a byte-identical data.mdb.

The table in docs/guarantees.md is generated from ``CASES``:
``python tests/store/test_bad_inputs.py`` prints it as Markdown.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import gib
from helpers.tensors import make_tensor, raw_bytes

from ecstore import ECStore, ECStoreConfig, InvalidEntryError, parse_key
from ecstore.key import MAX_IDENTIFIER_BYTES, MAX_MODEL_NAME_BYTES

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*(Sparse CSR|quantize_per_tensor|nested tensors|ComplexHalf).*:UserWarning")

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
KiB = 1 << 10
MEM_CAP = 64 * KiB
DISK_CAP = 256 * KiB
BF16 = torch.bfloat16


#: Sub-byte integer dtypes: torch makes such tensors but cannot copy them.
SUB_BYTE = [getattr(torch, f"{sign}int{bits}") for sign in ("u", "") for bits in range(1, 8)]


def bf16(rows: int = 4, cols: int = 16, seed: int = 11) -> torch.Tensor:
    return make_tensor(seed, rows, cols, BF16)


def nan_inf() -> torch.Tensor:
    t = torch.tensor([[float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40, 3.0e38, -1.0]] * 2,
                     dtype=torch.float32).to(BF16)
    bits = t.view(torch.int16).clone()
    bits[1, 0] = 0x7FC1  # a NaN with a payload
    bits[1, 1] = -0x7F  # 0xFF81: a negative NaN with a payload
    return bits.view(BF16)


@dataclass(frozen=True)
class Case:
    name: str  # the table's "input" column
    make: Callable[[], dict[str, Any]]  # put: {"tensor", "ident"}; open: {"model", "dtype"}
    outcome: str  # "InvalidEntryError" | "refused" | "accepted"
    note: str = ""
    op: str = "put"  # "put" (on a bf16 handle) | "open" (ECStore constructor)
    where: str = "both tiers"  # accepted puts: "both tiers" | "disk only" | "memory only"
    handle_dtype: torch.dtype = BF16
    caps: tuple[int, int] = (MEM_CAP, DISK_CAP)  # (memory, disk)
    expect: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)


def put(tensor: Any, ident: str = "img-ok") -> Callable[[], dict[str, Any]]:
    return lambda: {"tensor": tensor() if callable(tensor) else tensor, "ident": ident}


def ident(i: Any) -> Callable[[], dict[str, Any]]:
    return lambda: {"tensor": bf16(), "ident": i}


def model(m: Any, dtype: Any = BF16) -> Callable[[], dict[str, Any]]:
    return lambda: {"model": m, "dtype": dtype}


CASES: list[Case] = [
    # --- not a tensor at all
    Case("a Python list", put([[1.0, 2.0]]), "InvalidEntryError"),
    Case("a numpy array", put(lambda: np.zeros((4, 16), dtype=np.float32)), "InvalidEntryError",
         "convert with torch.from_numpy"),
    Case("None", put(None), "InvalidEntryError"),
    # --- shape
    Case("0-d tensor", put(lambda: torch.tensor(1.0, dtype=BF16)), "InvalidEntryError",
         "encoder outputs are 2-D [tokens, hidden]"),
    Case("1-d tensor [16]", put(lambda: bf16(1, 16).reshape(16)), "InvalidEntryError"),
    Case("3-d tensor [1, 4, 16]", put(lambda: bf16().unsqueeze(0)), "InvalidEntryError",
         "squeeze the batch dimension first"),
    Case("zero rows [0, 16]", put(lambda: torch.empty(0, 16, dtype=BF16)), "InvalidEntryError",
         "nothing to cache"),
    Case("zero columns [4, 0]", put(lambda: torch.empty(4, 0, dtype=BF16)), "InvalidEntryError"),
    # --- layout / device / kind
    Case("non-contiguous: transposed", put(lambda: bf16(16, 4).t()), "accepted",
         "copied to a contiguous tensor", expect=lambda t: t.contiguous()),
    Case("non-contiguous: every other row", put(lambda: bf16(8, 16)[::2]), "accepted",
         "copied to a contiguous tensor", expect=lambda t: t.contiguous()),
    Case("non-contiguous: expanded (stride 0)", put(lambda: bf16(1, 16).expand(4, 16)), "accepted",
         "materialised: 4 real rows", expect=lambda t: t.contiguous()),
    Case("view with a storage offset", put(lambda: bf16(8, 16)[4:]), "accepted", "only the view is stored"),
    Case("requires_grad=True", put(lambda: bf16().requires_grad_(True)), "accepted",
         "stored detached", expect=lambda t: t.detach()),
    Case("sparse COO", put(lambda: bf16().to_sparse()), "InvalidEntryError", "call .to_dense() first"),
    Case("sparse CSR", put(lambda: bf16().float().to_sparse_csr()), "InvalidEntryError"),
    Case("meta device", put(lambda: torch.empty(4, 16, dtype=BF16, device="meta")), "InvalidEntryError",
         "no data"),
    Case("quantized (qint8)", put(lambda: torch.quantize_per_tensor(torch.ones(4, 16), 0.1, 0, torch.qint8)),
         "InvalidEntryError", "dequantize first"),
    Case("nested tensor", put(lambda: torch.nested.nested_tensor([bf16(2, 16), bf16(3, 16)])),
         "InvalidEntryError"),
    # --- dtype
    Case("float16 into a bfloat16 handle", put(lambda: bf16().to(torch.float16)), "InvalidEntryError",
         "the handle's dtype is part of the key"),
    Case("float32 into a bfloat16 handle", put(lambda: bf16().float()), "InvalidEntryError"),
    Case("complex128 (handle complex128)", put(lambda: torch.ones(4, 16, dtype=torch.complex128)),
         "InvalidEntryError", "no safetensors code", handle_dtype=torch.complex128),
    Case("float8_e8m0fnu (handle float8_e8m0fnu)",
         put(lambda: torch.arange(64, dtype=torch.uint8).view(torch.float8_e8m0fnu).reshape(4, 16)), "accepted",
         "stored as U8 bytes, dtype in the header", handle_dtype=torch.float8_e8m0fnu),
    Case("uint4 (handle uint4)", put(lambda: torch.zeros(4, 16, dtype=torch.uint4)), "InvalidEntryError",
         "sub-byte integers (uint1-uint7, int1-int7), copy=True or False", handle_dtype=torch.uint4),
    Case("int1 (handle int1)", put(lambda: torch.zeros(4, 16, dtype=torch.int1)), "InvalidEntryError",
         handle_dtype=torch.int1),
    # --- content
    Case("NaN, ±Inf, -0.0, subnormals, NaN payloads", put(nan_inf), "accepted", "stored bit for bit"),
    # --- size
    Case("larger than the memory tier, fits the disk tier", put(lambda: bf16(64, 1024)), "accepted",
         "128 KiB: disk only", where="disk only"),
    Case("larger than the disk tier, fits the memory tier", put(lambda: bf16(64, 1024)), "accepted",
         "128 KiB: memory only (not persisted)", where="memory only", caps=(256 * KiB, 64 * KiB)),
    Case("larger than both tiers", put(lambda: bf16(256, 1024)), "refused",
         "512 KiB: returns False, logs a warning"),
    # --- identifiers
    Case("empty identifier", ident(""), "InvalidEntryError"),
    Case(f"identifier of {MAX_IDENTIFIER_BYTES} bytes", ident("x" * MAX_IDENTIFIER_BYTES), "accepted",
         "the longest accepted"),
    Case("identifier of 10 KB", ident("x" * 10_000), "InvalidEntryError",
         f"more than {MAX_IDENTIFIER_BYTES} UTF-8 bytes"),
    Case("identifier with '@'", ident("img@v2@0"), "accepted", "hashed into the key, never parsed"),
    Case("identifier with '/'", ident("s3://bucket/img.png"), "accepted"),
    Case("identifier with NUL", ident("img\x00tail"), "accepted"),
    Case("identifier with non-ASCII text", ident("图像-🖼️-é"), "accepted"),
    Case("identifier with a lone surrogate", ident("img\udc80"), "InvalidEntryError", "not valid Unicode"),
    Case("identifier of type bytes", ident(b"img"), "InvalidEntryError", "must be str"),
    # --- model names (ECStore constructor)
    Case("model name with '@'", model("org/model@rev2"), "accepted", "keys are parsed from the right",
         op="open"),
    Case("model name with '/'", model("org/sub/model"), "accepted", op="open"),
    Case(f"model name of {MAX_MODEL_NAME_BYTES + 1} bytes", model("m" * (MAX_MODEL_NAME_BYTES + 1)),
         "InvalidEntryError", f"LMDB keys hold 511 bytes; at most {MAX_MODEL_NAME_BYTES}", op="open"),
    Case("model name with NUL", model("org/model\x00x"), "InvalidEntryError", op="open"),
    Case("empty model name", model(""), "InvalidEntryError", op="open"),
    Case("model name with a lone surrogate", model("model\udc80"), "InvalidEntryError", op="open"),
    Case("dtype given as a string", model(MODEL, "bfloat16"), "InvalidEntryError", "pass torch.bfloat16",
         op="open"),
]


# --------------------------------------------------------------------------
# Fixtures and helpers
# --------------------------------------------------------------------------

def config(path: Path, caps: tuple[int, int]) -> ECStoreConfig:
    return ECStoreConfig(local_cpu=True, max_local_cpu_size=gib(caps[0]), local_disk=str(path),
                         max_local_disk_size=gib(caps[1]))


def open_store(path: Path, case: Case, **kw: Any) -> ECStore:
    return ECStore(config(path, case.caps), model=kw.get("model", MODEL), dtype=kw.get("dtype", case.handle_dtype))


def baseline(store: ECStore) -> None:
    """Two ordinary entries, flushed (through a bfloat16 handle on the same
    directory when the store's own dtype cannot be stored)."""
    if store.dtype in (torch.complex128, *SUB_BYTE):
        with ECStore(store.config, model=MODEL, dtype=BF16) as side:
            baseline(side)
        return
    for i in range(2):
        assert store.put(f"base-{i}", make_tensor(i, 4, 16, store.dtype))
    store.flush()


def snapshot(store: ECStore) -> dict[str, Any]:
    """Everything a refusal must leave as it was (call after flush())."""
    disk = {k: r.identifier for k, r in store.disk.iter_records()}
    st = store.stats()
    data = Path(store.disk.path) / "data.mdb"
    return {"disk": disk, "disk_bytes": st.disk_bytes, "memory": store.memory.keys(),
            "memory_bytes": st.memory_bytes, "puts": st.puts,
            "data.mdb": hashlib.sha256(data.read_bytes()).hexdigest()}


def dir_state(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and raw_bytes(a) == raw_bytes(b)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ecstore" and r.levelno >= logging.WARNING]


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------

PUT_CASES = [c for c in CASES if c.op == "put"]
OPEN_CASES = [c for c in CASES if c.op == "open"]


@pytest.mark.parametrize("case", PUT_CASES, ids=[c.name for c in PUT_CASES])
def test_put(tmp_path, caplog, case: Case):
    path = tmp_path / "s"
    store = open_store(path, case)
    try:
        baseline(store)
        before = snapshot(store)
        args = case.make()
        caplog.clear()
        if case.outcome == "InvalidEntryError":
            with pytest.raises(InvalidEntryError):
                store.put(args["ident"], args["tensor"])
            if not isinstance(args["ident"], str) or args["ident"] != "img-ok":  # a bad identifier:
                for op in (store.get, store.contains, store.delete):  # every call refuses it
                    with pytest.raises(InvalidEntryError):
                        op(args["ident"])
        elif case.outcome == "refused":
            assert store.put(args["ident"], args["tensor"]) is False
            assert any("refused" in m for m in warnings_of(caplog)), warnings_of(caplog)
            assert store.stats().puts_refused == 1
            assert store.get(args["ident"]) is None
        else:
            original = args["tensor"]
            want = (case.expect or (lambda t: t))(original).clone()
            assert store.put(args["ident"], original) is True
            assert not warnings_of(caplog), warnings_of(caplog)
            store.flush()
            got = store.get(args["ident"])
            assert got is not None and got.is_contiguous() and not got.requires_grad
            assert same_bits(got, want)
            key = store.key(args["ident"])
            on_disk = store.disk.get(key, store.stored_name(args["ident"])) is not None
            in_memory = store.memory.contains(key, store.stored_name(args["ident"]))
            assert (in_memory, on_disk) == {"both tiers": (True, True), "disk only": (False, True),
                                            "memory only": (True, False)}[case.where]
            assert same_bits(original, (case.expect or (lambda t: t))(original))  # caller's tensor untouched
            store.close()
            store = open_store(path, case)  # what a restart sees
            got = store.get(args["ident"])
            if on_disk:
                assert got is not None and same_bits(got, want)
            else:
                assert got is None
            return
        store.flush()
        assert snapshot(store) == before, "a refused put changed the store"
    finally:
        store.close()


@pytest.mark.parametrize("case", OPEN_CASES, ids=[c.name for c in OPEN_CASES])
def test_model_name(tmp_path, case: Case):
    path = tmp_path / "s"
    with open_store(path, case) as s:  # an existing store with entries
        baseline(s)
    before = dir_state(path)
    args = case.make()
    if case.outcome == "InvalidEntryError":
        with pytest.raises(InvalidEntryError):
            open_store(path, case, model=args["model"], dtype=args["dtype"])
        assert dir_state(path) == before, "a refused open changed the store directory"
        return
    with open_store(path, case, model=args["model"], dtype=args["dtype"]) as s:
        t = bf16(seed=5)
        assert s.put("img-1", t)
        s.flush()
        key = s.key("img-1")
        assert parse_key(key).model == args["model"]
        assert same_bits(s.get("img-1"), t)
    with open_store(path, case) as other:  # the default model's entries are untouched...
        assert other.get("img-1") is None  # ...and never confused with this model's
        assert other.get("base-0") is not None
    with open_store(path, case, model=args["model"], dtype=args["dtype"]) as s:
        assert same_bits(s.get("img-1"), t)


@pytest.mark.parametrize("copy", [True, False], ids=["copy", "no-copy"])
@pytest.mark.parametrize("dtype", SUB_BYTE, ids=[str(d).removeprefix("torch.") for d in SUB_BYTE])
def test_sub_byte_integer_dtypes_are_refused_at_put(tmp_path, dtype: torch.dtype, copy: bool):
    """``put`` of a uint1-uint7/int1-int7 tensor raised torch's
    NotImplementedError (copy=True), or was accepted and then failed in the
    background writer, flush() reporting StoreFullError (copy=False): it is an
    InvalidEntryError at put, and nothing is queued."""
    with ECStore(config(tmp_path / "s", (MEM_CAP, DISK_CAP)), model=MODEL, dtype=dtype) as store:
        with pytest.raises(InvalidEntryError, match="sub-byte"):
            store.put("img", torch.zeros(4, 16, dtype=dtype), copy=copy)
        store.flush()
        assert store.get("img") is None and store.stats().puts == 0


@pytest.mark.parametrize("device", ["xpu", "cuda:99", "bogus", 7, -1, None, "meta", "mps"],
                         ids=["xpu", "cuda:99", "bogus", "7", "-1", "None", "meta", "mps"])
def test_get_on_a_device_this_process_has_not_is_refused_before_anything_is_counted(tmp_path, device: object):
    """``get(device=...)`` let AssertionError ("xpu", "cuda" on a CPU build),
    RuntimeError ("bogus", 7) and TypeError (None) through after counting a
    hit and touching the LRU, and "meta" returned a tensor without data: a
    device tensors cannot be placed on is an InvalidEntryError, the hit not
    counted, and the entry is still served on the CPU."""
    with ECStore(config(tmp_path / "s", (MEM_CAP, DISK_CAP)), model=MODEL, dtype=BF16) as store:
        t = bf16()
        assert store.put("img", t)
        store.flush()
        before = store.stats()
        with pytest.raises(InvalidEntryError, match="device"):
            store.get("img", device=device)  # type: ignore[arg-type]
        with pytest.raises(InvalidEntryError, match="device"):
            store.get("never-stored", device=device)  # type: ignore[arg-type]
        after = store.stats()
        assert (after.hits, after.misses) == (before.hits, before.misses)
        assert same_bits(store.get("img", device=torch.device("cpu")), t)
        assert same_bits(store.get("img", device="cpu:0"), t)


def test_every_case_has_a_known_outcome():
    assert {c.outcome for c in CASES} <= {"InvalidEntryError", "refused", "accepted"}
    assert len({c.name for c in CASES}) == len(CASES)


# --------------------------------------------------------------------------
# The bad-input table of docs/guarantees.md
# --------------------------------------------------------------------------

OUTCOME_TEXT = {
    "InvalidEntryError": "raises `InvalidEntryError`",
    "refused": "refused: `put` returns False, warning logged",
    "accepted": "accepted",
}


def markdown_table() -> str:
    rows = ["| Input | Call | Outcome | Notes |", "|---|---|---|---|"]
    for c in CASES:
        call = "`ECStore(model=..., dtype=...)`" if c.op == "open" else "`put`"
        if c.op == "put" and "identifier" in c.name and c.outcome == "InvalidEntryError":
            call = "`put`/`get`/`contains`/`delete`"
        out = OUTCOME_TEXT[c.outcome]
        if c.outcome == "accepted" and c.op == "put":
            out += " (bit-exact)" + ("" if c.where == "both tiers" else f", {c.where}")
        name = c.name.replace("|", "\\|")
        rows.append(f"| {name} | {call} | {out} | {c.note} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
