"""`train.compile`: the setting, the compiled step against the eager one (every family), exact resume with
it on, the one-line fallback, and the loss check the step no longer waits for.

torch.compile runs with the aot_eager backend here (the same traced forward and backward graphs, run by
torch's own kernels): inductor's first compile of even the toy model takes over a minute on two shared
cores. The GPU script (tests/benchmarks/gpu_all.py) checks inductor against eager on CUDA."""

from __future__ import annotations

import logging
import math
from collections import Counter

import numpy as np
import pytest
import torch

from model import FAMILIES
from model.layers.attention import static_layout
from pipelines.engine import compiled
from pipelines.engine.checkpoints import latest_checkpoint
from pipelines.engine.config_io import apply_overrides
from pipelines.engine.launch import fit
from pipelines.engine.run_log import read_metrics
from pipelines.engine.trainer import NonFiniteLoss, TrainConfig
from tests.model.test_architectures import PIXEL_AND_TOKEN_INPUTS, _inputs, _smallest_preset
from tests.pipelines.engine.test_trainer import CrashingTask, ToyTask, _cfg, _Crash, _weights

_FALLBACK = "train.compile: the compiled step failed"


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")


class _NoDropout(ToyTask):
    """The toy task without dropout: compiled code draws its random numbers its own way."""

    def build_model(self) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def test_the_setting_is_refused_by_name_and_read_from_yaml_booleans():
    with pytest.raises(
        ValueError, match=r"^train settings: train\.compile='sometimes' must be one of"
    ) as bad:
        TrainConfig(compile="sometimes")
    assert "\n" not in str(bad.value)
    settings = ("on", "off", "auto", "reduce-overhead")
    assert [apply_overrides(TrainConfig(), [f"compile={v}"]).compile for v in settings] == list(settings)
    with pytest.raises(ValueError, match=r"compile=1 is not one of \['auto', 'on', 'off', 'reduce-o"):
        apply_overrides(TrainConfig(), ["compile=1"])
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [compiled.wants_compile(s, cpu) for s in settings] == [True, False, False, True]
    assert [compiled.wants_compile(s, cuda) for s in settings] == [True, False, True, True]
    with pytest.raises(ValueError, match=r"^train\.compile='yes' must be one of"):
        compiled.wants_compile("yes", cpu)


def test_reduce_overhead_asks_for_cuda_graphs_on_cuda_and_compiles_plainly_elsewhere(caplog):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [compiled.compile_mode(s, cuda) for s in ("on", "auto", "reduce-overhead")] == [
        None,
        None,
        "reduce-overhead",
    ]
    with caplog.at_level(logging.WARNING):
        assert compiled.compile_mode("reduce-overhead", cpu) is None
        assert compiled.compile_mode("on", cpu) is None
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "train.compile=reduce-overhead: CUDA graphs need a CUDA device; "
        "compiling the step without them on cpu"
    ]


class _Uneven(_NoDropout):
    """60 examples: batches of 8 leave 4 over in every epoch."""

    def train_dataset(self):
        return [(x, y) for x, y in zip(*_points(60), strict=True)]


def _points(n: int):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return list(x), list((x @ np.array([1.0, -2.0, 0.5, 3.0])).astype(np.float32))


def test_a_compiled_run_compiles_once_though_the_set_is_not_a_whole_number_of_batches(tmp_path, monkeypatch):
    """Every step's batch is full (the remainder waits for the next epoch's shuffle, as the release's
    drop_last does): the step is traced and compiled once in three epochs and reduce-overhead's static
    shapes hold."""
    graphs: list[torch.fx.GraphModule] = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(compiled, "BACKEND", counting)
    fit(_Uneven(), _cfg(epochs=3, compile="reduce-overhead", log_every=7), tmp_path)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert rows[-1]["step"] == 21  # 7 full batches of 8 an epoch
    assert len(graphs) == 1
    shapes = {tuple(n.meta["example_value"].shape) for n in graphs[0].graph.nodes if n.op == "placeholder"}
    assert (8, 4) in shapes


@pytest.mark.slow  # ~10 s a family on two shared cores: dynamo traces the whole model
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_compiles_to_the_eager_forward_and_backward(family, aot_eager):
    torch.manual_seed(0)
    cfg = _smallest_preset(family)
    model = FAMILIES[family].models["backbone"](cfg).eval()  # no dropout: the same arithmetic both ways
    table = PIXEL_AND_TOKEN_INPUTS.get(family)
    inputs = table(cfg) if table is not None else _inputs(cfg, "backbone")

    def step(call) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the dVAE's Gumbel noise
        out = call(**inputs)
        floats = [v for v in vars(out).values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        loss = sum(v.float().square().mean() for v in floats)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    want_loss, want = step(model)  # the reference: eager, padding-free rows
    with static_layout():  # as the trainer runs a compiled step
        got_loss, got = step(compiled.compile_model(model))
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert want and got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_compiled_run_equals_the_eager_run(tmp_path, aot_eager):
    fit(_NoDropout(), _cfg(epochs=2, compile="off"), tmp_path / "eager")
    fit(_NoDropout(), _cfg(epochs=2, compile="on"), tmp_path / "compiled")
    a, b = _weights(tmp_path / "eager" / "last"), _weights(tmp_path / "compiled" / "last")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)
    runs = ("eager", "compiled")
    losses = [[r["loss"] for r in read_metrics(tmp_path / d / "metrics.jsonl") if "loss" in r] for d in runs]
    assert len(losses[0]) == 8
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


def test_resume_is_exact_with_compile_on(tmp_path, aot_eager):
    """Dropout included: the compiled step draws from the step's seed, so a resumed run repeats it."""
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    fit(ToyTask(), _cfg(epochs=3, log_every=4, compile="on", optimizer="bertadam"), straight)
    with pytest.raises(_Crash):
        fit(
            CrashingTask(after=10),
            _cfg(epochs=3, save_every=10, log_every=4, compile="on", optimizer="bertadam"),
            halves,
        )
    assert latest_checkpoint(halves / "checkpoints").name == "step-10"
    fit(ToyTask(), _cfg(epochs=3, log_every=4, compile="on", optimizer="bertadam"), halves, resume=True)
    a, b = _weights(straight / "last"), _weights(halves / "last")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    rows = [[r["loss"] for r in read_metrics(d / "metrics.jsonl") if "loss" in r] for d in (straight, halves)]
    assert rows[0] == rows[1]


def _refuse(gm, example_inputs):
    raise RuntimeError("this backend compiles nothing\nsecond line of the error")


def test_a_model_that_cannot_compile_trains_eagerly_after_one_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(compiled, "BACKEND", _refuse)
    with caplog.at_level(logging.WARNING):
        fit(_NoDropout(), _cfg(epochs=2, compile="on"), tmp_path / "fallback")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(_FALLBACK)]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "this backend compiles nothing" in lines[0] and "second line" not in lines[0]
    fit(_NoDropout(), _cfg(epochs=2, compile="off"), tmp_path / "eager")
    # the failed step ran again eagerly from the same batches and seed: the very same run
    a, b = _weights(tmp_path / "eager" / "last"), _weights(tmp_path / "fallback" / "last")
    assert all(torch.equal(a[k], b[k]) for k in a)


class _GoesNonFinite(ToyTask):
    """The loss of step 3 (and on) is NaN; its terms are tensors, as a task that never syncs returns them."""

    def __init__(self):
        self.calls = 0

    def loss(self, model, batch):
        self.calls += 1
        loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
        if self.calls >= 3:
            loss = loss * float("nan")
        return loss, {"mse": loss.detach(), "steady": torch.tensor(1.0)}


def test_a_non_finite_loss_stops_the_run_at_the_next_log_or_checkpoint_naming_its_step(tmp_path):
    with pytest.raises(NonFiniteLoss) as stopped:
        fit(_GoesNonFinite(), _cfg(epochs=2, log_every=5, save_every=2), tmp_path)
    line = str(stopped.value)
    assert line.startswith("loss is nan at step 3 (mse=nan);") and "steady" not in line
    assert "the last good checkpoint is" in line and line.split(";")[1].strip().endswith("step-2")
    # the check before the step-4 checkpoint stopped the run: no checkpoint holds a non-finite step
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step-2"


def test_logged_terms_from_tensors_equal_those_from_floats(tmp_path):
    class Floats(_NoDropout):
        def loss(self, model, batch):
            loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
            return loss, {"mse": loss.item()}

    class Tensors(_NoDropout):
        def loss(self, model, batch):
            loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
            return loss, {"mse": loss.detach()}

    fit(Floats(), _cfg(epochs=2, log_every=3), tmp_path / "floats")
    fit(Tensors(), _cfg(epochs=2, log_every=3), tmp_path / "tensors")
    rows = [
        [r for r in read_metrics(tmp_path / d / "metrics.jsonl") if "loss" in r]
        for d in ("floats", "tensors")
    ]
    assert [r["step"] for r in rows[0]] == [3, 6, 9, 12, 15, 16]
    for a, b in zip(*rows, strict=True):
        assert (a["loss"], a["mse"]) == (b["loss"], b["mse"]) and math.isfinite(a["mse"])


def _pretraining(family: str, labels: str) -> tuple[torch.nn.Module, dict]:
    """A tiny pre-training model of `family` and a batch with padding, masked words and masked regions
    (`labels`: the regions' targets as class distributions, "probs", or as top classes, "labels")."""
    from model import LxmertConfig, LxmertForPreTraining
    from model.vilbert import VilbertConfig, VilbertForPreTraining
    from model.visualbert import VisualBertConfig, VisualBertForPreTraining
    from model.vlbert import VlBertConfig, VlBertForPreTraining
    from tests.benchmarks.bench_model import make_batch

    torch.manual_seed(0)
    if family == "vilbert":
        cfg = VilbertConfig.preset("tiny")
        model = VilbertForPreTraining(cfg)
        words = make_batch(LxmertConfig.preset("tiny"), 4, 12, 10)
        batch = {k: words[k] for k in ("input_ids", "attention_mask", "token_type_ids", "lm_labels")}
        g = torch.Generator().manual_seed(1)
        batch.update(
            visual_feats=torch.randn(4, 10, cfg.visual_feat_dim, generator=g),
            visual_pos=words["visual_pos"].sort(-1).values,
            matched_labels=words["matched_labels"],
            region_mask=(torch.rand(4, 10, generator=g) < 0.3).float(),
        )
        batch["region_mask"][:, 0] = 1
        targets = cfg.v_target_size
    elif family == "vlbert":
        cfg = VlBertConfig.preset("tiny")
        model = VlBertForPreTraining(cfg)
        words = make_batch(LxmertConfig.preset("tiny"), 4, 12, 10)
        g = torch.Generator().manual_seed(1)
        batch = {k: words[k] for k in ("input_ids", "attention_mask", "token_type_ids", "lm_labels")}
        batch.update(
            visual_feats=torch.randn(4, 10, cfg.visual_feat_dim, generator=g),
            visual_pos=words["visual_pos"].sort(-1).values,
            region_mask=(torch.rand(4, 10, generator=g) < 0.3).float(),
        )
        batch["region_mask"][:, 0] = 1
        targets = cfg.num_region_classes
    elif family == "visualbert":
        cfg = VisualBertConfig.preset("tiny")
        model = VisualBertForPreTraining(cfg)
        words = make_batch(LxmertConfig.preset("tiny"), 4, 12, 10)
        batch = {k: words[k] for k in ("input_ids", "attention_mask", "token_type_ids", "lm_labels")}
        batch.update(
            visual_feats=torch.randn(4, 10, cfg.visual_feat_dim, generator=torch.Generator().manual_seed(1)),
            matched_labels=words["matched_labels"],
        )
        return model, batch
    else:
        cfg = LxmertConfig.preset("tiny")
        return LxmertForPreTraining(cfg), make_batch(cfg, 4, 12, 10)
    g = torch.Generator().manual_seed(2)
    if labels == "probs":
        batch["region_probs"] = torch.softmax(torch.randn(4, 10, targets, generator=g), -1)
    else:
        batch["region_labels"] = torch.randint(0, targets, (4, 10), generator=g)
        batch["region_weights"] = torch.rand(4, 10, generator=g)
    return model, batch


@pytest.mark.parametrize(
    ("family", "labels"),
    [
        ("lxmert", "probs"),
        *(
            pytest.param(*case, marks=pytest.mark.slow)  # 15-80 s each on two shared cores
            for case in [
                ("visualbert", "probs"),
                ("vlbert", "probs"),
                ("vlbert", "labels"),
                ("vilbert", "probs"),
                ("vilbert", "labels"),
            ]
        ),
    ],
)
def test_a_pretraining_step_compiles_whole_and_equals_the_reference(family, labels):
    """Under the static layout the forward and every loss is one graph (fullgraph: no break, so no host
    sync); its losses and gradients equal the padding-free eager step's."""
    model, batch = _pretraining(family, labels)
    model.eval()  # no dropout: the same arithmetic both ways
    assert (batch["attention_mask"] == 0).any(), "the batch has padding for the layouts to differ on"

    def step(call) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        out = call(**batch)
        out.loss.backward()
        losses = {k: v.detach() for k, v in out.losses.items()}
        return losses, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    want_losses, want = step(model)
    with static_layout():
        got_losses, got = step(torch.compile(model, backend="aot_eager", fullgraph=True))
    assert len(want_losses) >= 2 and set(got_losses) == set(want_losses)
    for k in want_losses:
        torch.testing.assert_close(got_losses[k], want_losses[k], rtol=1e-5, atol=1e-6, msg=k)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow  # the generated store and three tiny-LXMERT runs, each traced once: ~1-2 min
def test_compile_on_trains_the_tiny_pretraining_preset_and_resumes_exactly(tmp_path, aot_eager, caplog):
    from safetensors.torch import load_file

    from pipelines.engine import config_io
    from pipelines.tasks.pretrain import PretrainTask
    from tests.pipelines.tasks.synthetic_pretrain import make_pretrain_data
    from tests.pipelines.tasks.test_pretrain import _run_config

    run = _run_config(make_pretrain_data(tmp_path / "data"), max_steps=4, compile="on", log_every=1)
    with caplog.at_level(logging.WARNING):
        fit(PretrainTask(run.task), run.train, tmp_path / "straight")
    assert not [r for r in caplog.records if r.getMessage().startswith(_FALLBACK)], "the compiled step ran"
    rows = [r for r in read_metrics(tmp_path / "straight" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(math.isfinite(r["mlm"]) for r in rows)

    class Crashing(PretrainTask):
        calls = 0

        def loss(self, model, batch):
            Crashing.calls += 1
            if Crashing.calls > 2:
                raise _Crash
            return super().loss(model, batch)

    halves = tmp_path / "halves"
    with pytest.raises(_Crash):
        fit(Crashing(run.task), config_io.merge(run, {"train": {"save_every": 2}}).train, halves)
    fit(PretrainTask(run.task), run.train, halves, resume=True)
    a = load_file(tmp_path / "straight" / "last" / "model.safetensors")
    b = load_file(halves / "last" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    resumed = [r["loss"] for r in read_metrics(halves / "metrics.jsonl") if "loss" in r]
    assert resumed == [r["loss"] for r in rows]


# ops that make the host wait for the device (a value read back, or an output whose size depends on data)
_HOST_SYNCS = (
    "aten._local_scalar_dense",
    "aten.item",
    "aten.nonzero",
    "aten.masked_select",
    "aten.unique",
    "aten._unique",
    "aten.unique_consecutive",
    "aten.repeat_interleave",
)


def _census(graphs: list[torch.fx.GraphModule]) -> tuple[Counter, list[str]]:
    """Every call in `graphs` by op name, and the calls that sync the host: those above, and indexing
    with a boolean mask (its output size is the mask's count)."""
    calls: Counter = Counter()
    syncs = []
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            name = str(node.target)
            calls[name] += 1
            masks = (
                [
                    a
                    for a in node.args[1] or []
                    if isinstance(a, torch.fx.Node) and a.meta["val"].dtype == torch.bool
                ]
                if name.startswith(("aten.index.", "aten.index_put"))
                else []
            )
            if name.startswith(_HOST_SYNCS) or masks:
                syncs.append(name)
    return calls, syncs


def test_a_compiled_lxmert_pretraining_step_is_one_graph_without_host_syncs():
    """The trainer's compiled step for LXMERT pre-training (dropout on, every loss): dynamo hands one
    graph to the backend, breaks nowhere, and neither its forward nor its backward (as AOT autograd
    splits them) holds an op that waits for the device."""
    from torch._dynamo.utils import counters
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

    model, batch = _pretraining("lxmert", "probs")
    model.train()
    dynamo_graphs: list[torch.fx.GraphModule] = []
    aot_graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}

    def keep(kind: str):
        def compiler(gm, example_inputs):
            aot_graphs[kind].append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    def census(gm, example_inputs):
        dynamo_graphs.append(gm)
        return aot_module_simplified(
            gm, example_inputs, fw_compiler=keep("forward"), bw_compiler=keep("backward")
        )

    torch._dynamo.reset()
    counters.clear()
    with static_layout():  # as the trainer runs a compiled step
        out = torch.compile(model, backend=census)(**batch)
        out.loss.backward()
    assert len(dynamo_graphs) == 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert len(aot_graphs["forward"]) == 1 and len(aot_graphs["backward"]) == 1
    calls, syncs = _census(aot_graphs["forward"] + aot_graphs["backward"])
    assert syncs == [], syncs
    assert len(out.losses) >= 4 and sum(calls.values()) > 100  # the whole step is in the graphs
    print(
        f"compiled LXMERT pre-training step: 1 graph, 0 breaks, 0 host syncs; "
        f"forward {sum(1 for n in aot_graphs['forward'][0].graph.nodes if n.op == 'call_function')} ops, "
        f"backward {sum(1 for n in aot_graphs['backward'][0].graph.nodes if n.op == 'call_function')} ops"
    )


def test_the_census_sees_a_host_sync_and_a_graph_break():
    """The census itself: a step that reads a value back breaks the graph; one that compacts by a mask is
    a data-dependent op in the graph once dynamo is told to keep such ops."""
    from torch._dynamo.utils import counters
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

    graphs: list[torch.fx.GraphModule] = []

    def census(gm, example_inputs):
        def keep(g, inputs):
            graphs.append(g)
            return make_boxed_func(g.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=keep)

    def masked_mean(x):
        return x[x > 0].mean()

    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch.compile(masked_mean, backend=census)(torch.randn(16))
    assert _census(graphs)[1] != []

    def reads_back(x):
        return x * float(x.sum())

    torch._dynamo.reset()
    counters.clear()
    graphs.clear()
    torch.compile(reads_back, backend=census)(torch.randn(16))
    assert counters["graph_break"]
