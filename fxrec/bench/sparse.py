"""Benchmark section: sparse inputs on the host.

(a) TensorDict -> KeyedJaggedTensor conversion, fxrec vs TorchRec's ``maybe_td_to_kjt``, on
    100 features x batch 512 x Poisson(20) ids. Also "ready" figures (conversion plus the
    per-key id counts every consumer needs: ``length_per_key()``), fxrec on inputs TorchRec
    cannot convert (weights and a variable batch size), and both on the same features held
    in one buffer (a loader that fills one): there fxrec's values are a view, no copy.
(b) Host-to-device transfer of those features: combined (pack + one copy each of values and
    lengths; and with the device-side ``permute_and_split`` back to per-feature tensors) vs
    per feature (values and lengths of each feature copied separately). Copies are counted
    with :func:`fxrec.measure.count_kernels` (``_to_copy``/``copy_``; the op's internal
    copies are inside its single node and not counted as transfers). Without a GPU the
    "device" copy is a copy into a reused host buffer, labelled as such: it shows the copy
    counts, not the per-transfer launch savings a GPU sees; on a CPU combining only adds
    passes over the data (the pack's fresh multi-MB buffers also page-fault).

Run alone: ``python -m fxrec.bench.sparse [--quick] [--device cuda]``.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

import torch

from fxrec.bench.common import interleaved_medians, print_table, write_json
from fxrec.measure import count_kernels
from fxrec.sparse import (
    JaggedTensor,
    kjt_from_tensordict,
    pack_features,
    permute_and_split,
    validation_disabled,
)

__all__ = ["run", "make_tensordict"]

logger = logging.getLogger(__name__)
_COPY_OPS = ("aten::_to_copy", "aten::copy_")


def make_tensordict(
    num_keys: int = 100,
    batch: int = 512,
    mean_ids: float = 20.0,
    weighted: bool = False,
    variable: bool = False,
    seed: int = 0,
    one_buffer: bool = False,
) -> Any:
    """A TensorDict of jagged nested tensors, ids per bag ~ Poisson(mean_ids).

    ``one_buffer``: the same features, but every feature's ids (and weights) are adjacent
    slices of one buffer and its offsets rows of one tensor, as a loader that fills one buffer
    per batch builds them.
    """
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    keys = [f"f{k}" for k in range(num_keys)]
    ids, offs, wts = [], [], []
    for _ in range(num_keys):
        b = int(torch.randint(batch // 2, batch + 1, (1,), generator=g)) if variable else batch
        lengths = torch.poisson(torch.full((b,), mean_ids), generator=g).long()
        offsets = torch.zeros(b + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(lengths, 0)
        n = int(offsets[-1])
        ids.append(torch.randint(0, 100_000, (n,), generator=g))
        offs.append(offsets)
        wts.append(torch.rand(n, generator=g) if weighted else None)
    if one_buffer:
        ids, offs = _one_buffer(ids), _one_buffer(offs)
        wts = _one_buffer(wts) if weighted else wts
    entries: dict[str, Any] = {}
    for k, i, o, w in zip(keys, ids, offs, wts):
        njt = torch.nested.nested_tensor_from_jagged(i, offsets=o)
        if w is None:
            entries[k] = njt
        else:
            wn = torch.nested.nested_tensor_from_jagged(w, offsets=o)
            entries[k] = TensorDict({"values": njt, "weights": wn}, batch_size=[o.numel() - 1])
    return TensorDict(entries, batch_size=[] if variable else [batch])


def _one_buffer(parts: list[Any]) -> list[torch.Tensor]:
    """The parts as adjacent views of one new buffer, in order."""
    return list(torch.cat(parts).split([p.numel() for p in parts]))


def _conversion(quick: bool) -> dict[str, Any]:
    steps, warmup = (30, 5) if quick else (150, 20)
    td = make_tensordict()
    fns: dict[str, Callable[[], object]] = {
        "fxrec": lambda: kjt_from_tensordict(td),
        "fxrec_ready": lambda: kjt_from_tensordict(td).length_per_key(),
    }
    with validation_disabled():
        no_val = kjt_from_tensordict(td)
    have_torchrec = True
    try:
        from torchrec.sparse.tensor_dict import maybe_td_to_kjt
    except ImportError:
        have_torchrec = False
        logger.info("torchrec not installed: TensorDict conversion measured for fxrec only")
    if have_torchrec:
        fns["torchrec"] = lambda: maybe_td_to_kjt(td)
        fns["torchrec_ready"] = lambda: maybe_td_to_kjt(td).length_per_key()
        ours, theirs = kjt_from_tensordict(td), maybe_td_to_kjt(td)
        same = torch.equal(ours.values(), theirs.values()) and torch.equal(
            ours.lengths(), theirs.lengths()
        )
        if not same:
            raise RuntimeError("fxrec and TorchRec TensorDict conversions disagree")
    del no_val
    wtd = make_tensordict(weighted=True, variable=True, seed=1)
    fns["fxrec_weighted_variable"] = lambda: kjt_from_tensordict(wtd)

    def _no_validation() -> object:
        with validation_disabled():
            return kjt_from_tensordict(td)

    fns["fxrec_no_validation"] = _no_validation
    # The floor both conversions share: copying every feature's ids into one tensor.
    ids = [td[k].values() for k in td.keys()]  # noqa: SIM118 (iterating a TD walks rows)
    fns["values_copy_floor"] = lambda: torch.cat(ids)
    # The same features with ids in one buffer (a loader that fills one): no floor to pay.
    otd = make_tensordict(one_buffer=True)
    fns["fxrec_one_buffer"] = lambda: kjt_from_tensordict(otd)
    ours = kjt_from_tensordict(otd)
    if ours.values().data_ptr() != otd["f0"].values().data_ptr():
        raise RuntimeError("one-buffer input: fxrec copied the ids")
    if have_torchrec:
        fns["torchrec_one_buffer"] = lambda: maybe_td_to_kjt(otd)
        theirs = maybe_td_to_kjt(otd)
        if not (
            torch.equal(ours.values(), theirs.values())
            and torch.equal(ours.lengths(), theirs.lengths())
        ):
            raise RuntimeError("fxrec and TorchRec disagree on the one-buffer input")
    med = interleaved_medians(fns, steps=steps, warmup=warmup)
    out: dict[str, Any] = {
        "shape": {"keys": 100, "batch": 512, "mean_ids": 20.0},
        "median_us": {k: v * 1e6 for k, v in med.items()},
    }
    rows = [
        ["fxrec kjt_from_tensordict", med["fxrec"] * 1e6, "-"],
        ["fxrec, no validation", med["fxrec_no_validation"] * 1e6, "-"],
        ["fxrec + length_per_key()", med["fxrec_ready"] * 1e6, "-"],
        ["fxrec, weighted + variable batch", med["fxrec_weighted_variable"] * 1e6, "-"],
    ]
    rows.append(["(floor: one cat of all ids)", med["values_copy_floor"] * 1e6, "-"])
    rows.append(["one-buffer input: fxrec (no copy)", med["fxrec_one_buffer"] * 1e6, "-"])
    if have_torchrec:
        floor = med["values_copy_floor"]
        out["speedup_vs_torchrec"] = med["torchrec"] / med["fxrec"]
        out["overhead_above_floor_ratio"] = (med["torchrec"] - floor) / max(
            med["fxrec"] - floor, 1e-9
        )
        out["speedup_vs_torchrec_ready"] = med["torchrec_ready"] / med["fxrec_ready"]
        out["speedup_vs_torchrec_one_buffer"] = med["torchrec_one_buffer"] / med["fxrec_one_buffer"]
        rows[0][2] = f"{out['speedup_vs_torchrec']:.2f}x"
        rows[2][2] = f"{out['speedup_vs_torchrec_ready']:.2f}x"
        rows[-1][2] = f"{out['speedup_vs_torchrec_one_buffer']:.2f}x"
        rows.insert(1, ["torchrec maybe_td_to_kjt", med["torchrec"] * 1e6, "1.00x"])
        rows.insert(3, ["torchrec + length_per_key()", med["torchrec_ready"] * 1e6, "1.00x"])
        rows.append(["one-buffer input: torchrec", med["torchrec_one_buffer"] * 1e6, "1.00x"])
        rows.append(
            ["time above the floor, torchrec / fxrec", out["overhead_above_floor_ratio"], "-"]
        )
    print_table(
        "TensorDict -> KJT, 100 keys x batch 512 x Poisson(20) ids, 1 host thread (median of interleaved steps)",
        ["variant", "median us", "speedup vs torchrec"],
        rows,
    )
    return out


def _transfer(quick: bool, device: str) -> dict[str, Any]:
    steps, warmup = (20, 3) if quick else (80, 10)
    jts: dict[str, JaggedTensor] = kjt_from_tensordict(make_tensordict(seed=2)).to_dict()
    on_gpu = torch.device(device).type == "cuda"
    if on_gpu:
        jts = {k: jt.pin_memory() for k, jt in jts.items()}

    # Without a GPU, a "device copy" is a copy into a host buffer kept from step to step, as
    # a device's caching allocator would hand out (fresh multi-MB host buffers would add page
    # faults that no device copy pays).
    buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def send(t: torch.Tensor) -> torch.Tensor:
        if on_gpu:
            return t.to(device, non_blocking=True)
        buf = buffers.get((t.numel(), t.dtype))
        if buf is None:
            buf = buffers.setdefault((t.numel(), t.dtype), torch.empty_like(t))
        return buf.copy_(t)

    def per_feature() -> object:
        return [(send(jt.values()), send(jt.lengths())) for jt in jts.values()]

    def combined() -> object:
        cf = pack_features(jts)
        if on_gpu:
            cf = cf.pin_memory()
        return cf, [send(t) for t in cf.tensors()]

    def combined_and_split() -> object:
        cf, (vals, lens) = combined()  # type: ignore[misc]
        return permute_and_split(
            vals, lens, None, cf.stride_per_key, cf.length_per_key, range(len(cf.keys))
        )

    def copies(fn: Callable[[], object]) -> int:
        ops = count_kernels(fn, backward=False).forward_ops
        return sum(n for name, n in ops.items() if name in _COPY_OPS)

    fns = {"per_feature": per_feature, "combined": combined, "combined_split": combined_and_split}
    counts = {name: copies(fn) for name, fn in fns.items()}
    med = interleaved_medians(fns, steps=steps, warmup=warmup, device=device)
    where = f"H2D to {device}" if on_gpu else "CPU only: copies into reused host buffers"
    base = med["per_feature"]
    print_table(
        f"Host-to-device, 100 features x batch 512 x Poisson(20) ids ({where})",
        ["variant", "copies", "median us", "speedup"],
        [
            ["per feature (values + lengths each)", counts["per_feature"], base * 1e6, "1.00x"],
            [
                "combined: pack + one copy each",
                counts["combined"],
                med["combined"] * 1e6,
                f"{base / med['combined']:.2f}x",
            ],
            [
                "  + permute_and_split (per-feature tensors)",
                counts["combined_split"],
                med["combined_split"] * 1e6,
                f"{base / med['combined_split']:.2f}x",
            ],
        ],
    )
    return {
        "device": device,
        "copy_kind": where,
        "copies": counts,
        "median_us": {k: v * 1e6 for k, v in med.items()},
        "speedup_combined": base / med["combined"],
        "speedup_combined_with_split": base / med["combined_split"],
    }


def run(quick: bool = False, device: str = "cpu") -> dict[str, Any]:
    """Run both parts; print tables; return JSON-able results.

    Host work runs on one intra-op thread, as in a DataLoader worker (which sets
    ``torch.set_num_threads(1)``); it also keeps OpenMP team stalls on a busy host out of the
    figures (see :func:`fxrec.sparse.segments.single_threaded`).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {"td_to_kjt": _conversion(quick), "h2d": _transfer(quick, device)}
    finally:
        torch.set_num_threads(threads)
    out["host_threads"] = 1
    out["goals"] = _goals(out["td_to_kjt"])
    return out


def _goals(conv: dict[str, Any]) -> list[dict[str, Any]]:
    """kjt_from_tensordict at least 2x TorchRec's maybe_td_to_kjt, per input kind."""
    goals = []
    for key, what in (
        ("speedup_vs_torchrec", "separate buffers: both copy the ids"),
        ("speedup_vs_torchrec_one_buffer", "one buffer: fxrec views it"),
    ):
        x = conv.get(key)
        if x is not None:
            goals.append(
                {
                    "goal": f"TD->KJT 2x faster than TorchRec ({what})",
                    "met": x >= 2.0,
                    "detail": f"{x:.2f}x",
                    "value": x,
                }
            )
    return goals


def main() -> None:  # pragma: no cover - CLI
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    write_json("sparse", run(args.quick, args.device))


if __name__ == "__main__":  # pragma: no cover
    main()
