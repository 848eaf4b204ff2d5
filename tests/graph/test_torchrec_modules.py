"""TorchRec's dense modules are traced through; its sparse modules are kept whole.

``torchrec.modules.mlp.MLP``, ``CrossNet`` and the arches of TorchRec's DLRM models are plain
tensor code: the capture must trace into them so that their layers fuse like ``nn.Linear``
towers do, while embedding collections, feature processors and ``torchrec.distributed``
modules stay one call each (the report names those that hold parameters). Every model is
trained side by side with an untouched copy: outputs, gradients by the original parameter
names and parameters after three SGD and Adagrad steps on fresh random batches must agree.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import fxrec
from fxrec.graph.capture import FxrecTracer

pytest.importorskip("torchrec")
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection, DLRMTrain
from torchrec.modules.crossnet import LowRankCrossNet
from torchrec.modules.mlp import MLP

pytestmark = [
    pytest.mark.torchrec,
    pytest.mark.filterwarnings("ignore:.*an autograd kernel was not registered"),
    pytest.mark.filterwarnings("ignore:.*is_fx_tracing"),
]

KEYS = ["f0", "f1", "f2"]
B = 8
TOL = 1e-5
OPTIMS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}


class Towers(nn.Module):
    """Four multi-task towers built from TorchRec's MLP on one input."""

    def __init__(self) -> None:
        super().__init__()
        self.towers = nn.ModuleList(MLP(24, [16, 8]) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([t(x) for t in self.towers], 1)


def _ebc() -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=50, feature_names=[k])
        for i, k in enumerate(KEYS)
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))


_ARCH = {
    "dense_in_features": 13,
    "dense_arch_layer_sizes": [16, 8],
    "over_arch_layer_sizes": [16, 1],
}
MODELS: dict[str, Callable[[], nn.Module]] = {
    "dlrm": lambda: DLRM(embedding_bag_collection=_ebc(), **_ARCH),
    "dlrm_dcn": lambda: DLRM_DCN(
        embedding_bag_collection=_ebc(), dcn_num_layers=2, dcn_low_rank_dim=4, **_ARCH
    ),
    "dlrm_projection": lambda: DLRM_Projection(
        embedding_bag_collection=_ebc(),
        interaction_branch1_layer_sizes=[24, 16],
        interaction_branch2_layer_sizes=[24, 16],
        **_ARCH,
    ),
    "dlrm_train": lambda: DLRMTrain(DLRM(embedding_bag_collection=_ebc(), **_ARCH)),
}


def _kjt(gen: torch.Generator) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (len(KEYS) * B,), generator=gen)
    values = torch.randint(0, 50, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths)


def _batch(name: str, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    if name == "towers":
        return (torch.randn(B, 24, generator=gen),)
    dense, kjt = torch.randn(B, 13, generator=gen), _kjt(gen)
    if name == "dlrm_train":
        labels = torch.randint(0, 2, (B,), generator=gen).float()
        return (Batch(dense_features=dense, sparse_features=kjt, labels=labels),)
    return dense, kjt


def _loss(out: object) -> torch.Tensor:
    """A loss that keeps gradients O(1): DLRMTrain returns its own."""
    return out[0] if isinstance(out, tuple) else torch.sigmoid(out).mean()  # type: ignore[index]


def _trains_like_the_model(name: str, model: nn.Module, optim: str) -> nn.Module:
    """Optimize ``model``, train it and an untouched copy three steps, compare everything."""
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, _batch(name, 0))
    o_opt, o_ref = OPTIMS[optim](list(opt.parameters())), OPTIMS[optim](list(ref.parameters()))
    for step in range(1, 4):
        batch = _batch(name, step)
        o_opt.zero_grad()
        o_ref.zero_grad()
        got, want = _loss(opt(*batch)), _loss(ref(*batch))
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
        got.backward()
        want.backward()
        grads = opt.fxrec_fused.grads(model)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=TOL, atol=TOL, msg=n)
        o_opt.step()
        o_ref.step()
    mine = opt.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(mine[k], v, rtol=TOL, atol=TOL, msg=k)
    return opt


@pytest.mark.parametrize("optim", sorted(OPTIMS))
def test_torchrec_mlp_towers_fuse_like_linear_towers(optim: str) -> None:
    opt = _trains_like_the_model("towers", Towers(), optim)
    report = opt.fxrec_report
    assert report.capture == "symbolic_trace"
    assert report.kernels_before == (17, 29)
    assert report.kernels_after == (5, 11)
    assert not any("kept whole" in n for n in report.notes)


@pytest.mark.parametrize("optim", sorted(OPTIMS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_torchrec_dlrm_models_train_like_the_model(name: str, optim: str) -> None:
    opt = _trains_like_the_model(name, MODELS[name](), optim)
    report = opt.fxrec_report
    assert report.capture == "symbolic_trace"
    kept = [n for n in report.notes if n.startswith("kept whole")]
    assert (
        len(kept) == 1
        and "sparse_arch.embedding_bag_collection (EmbeddingBagCollection)" in kept[0]
    )
    if name == "dlrm_projection":  # its two interaction branches fuse
        assert report.kernels_before == (23, 39)
        assert report.kernels_after == (19, 33)


def test_sparse_modules_stay_whole_and_dense_ones_are_traced() -> None:
    tracer = FxrecTracer()
    dlrm = MODELS["dlrm"]()
    assert tracer.is_leaf_module(dlrm.sparse_arch.embedding_bag_collection, "ebc")
    for dense in (
        dlrm.sparse_arch,
        dlrm.dense_arch,
        dlrm.over_arch,
        MLP(4, [4]),
        LowRankCrossNet(4, 2, 2),
    ):
        assert not tracer.is_leaf_module(dense, "dense")


class RegroupedTowers(nn.Module):
    """Two collections regrouped by TorchRec's ``KTRegroupAsDict``, which builds its permutes
    into empty buffers on its first call and flags itself set up."""

    def __init__(self) -> None:
        super().__init__()
        from torchrec.modules.regroup import KTRegroupAsDict

        def ebc(name: str, key: str) -> EmbeddingBagCollection:
            cfg = EmbeddingBagConfig(
                name=name, embedding_dim=4, num_embeddings=10, feature_names=[key]
            )
            return EmbeddingBagCollection(tables=[cfg])

        self.e1, self.e2 = ebc("a", "f0"), ebc("b", "f1")
        self.regroup = KTRegroupAsDict(groups=[["f1", "f0"]], keys=["u"])

    def forward(self, k1: KeyedJaggedTensor, k2: KeyedJaggedTensor) -> torch.Tensor:
        return self.regroup([self.e1(k1), self.e2(k2)])["u"]


def test_a_module_set_up_on_its_first_call_stays_set_up() -> None:
    def batch(seed: int) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
        g = torch.Generator().manual_seed(seed)
        return tuple(
            KeyedJaggedTensor(
                keys=[k],
                values=torch.randint(0, 10, (6,), generator=g),
                lengths=torch.full((3,), 2),
            )
            for k in ("f0", "f1")
        )

    torch.manual_seed(0)
    model = RegroupedTowers()
    ref = copy.deepcopy(model)
    opt = fxrec.optimize(model, batch(0))  # the model's first call is fxrec's
    for seed in (1, 2):
        torch.testing.assert_close(opt(*batch(seed)), ref(*batch(seed)), rtol=0, atol=0)
        torch.testing.assert_close(model(*batch(seed)), ref(*batch(seed)), rtol=0, atol=0)
