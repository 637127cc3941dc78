"""The NKI attention processor inside diffusers' WanTransformer3DModel against diffusers' own forward.

Numerics (tests/numerics.py rule): the baseline is diffusers' model with its own processor in float64;
``ref_err`` is diffusers' own error in the tested dtype (its default processor, same weights, vs that
baseline); the model with the project's processor must be within ``2 * ref_err + floor``. Outputs are
O(1) (max |out| ~ 4), the scale the floors assume.
"""

from __future__ import annotations

import contextlib
import copy
import io
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from nki_kernels import ops
from tests import numerics
from tests.pipeline_helpers import one_thread as one_thread  # autouse: one intra-op thread

try:  # the `test` extra installs diffusers: without it these tests must fail, never skip
    import diffusers
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor
except ImportError as exc:
    raise ImportError(
        "tests/test_integrations_diffusers.py needs diffusers (WanTransformer3DModel, the model the "
        "processor is compared with): pip install -e '.[test]'"
    ) from exc

from nki_ardiff.integrations.diffusers import NkiWanAttnProcessor, install_nki_attention


@dataclass(frozen=True)
class Case:
    """A small Wan transformer and its inputs: latents [B, C, F, H, W] (patch 1x2x2), text [B, Lt, 32]."""

    heads: int
    head_dim: int
    layers: int
    batch: int
    frames: int
    hw: tuple[int, int]
    text: int
    fused: bool = False

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.frames, self.hw[0] // 2, self.hw[1] // 2


CASES = {
    # head_dim 64 (RoPE split 12/10/10 pairs), two samples at different timesteps, square grid
    "h2d64": Case(heads=2, head_dim=64, layers=2, batch=2, frames=3, hw=(8, 8), text=16),
    # head_dim 40 (not a multiple of 6: 8/6/6), 3 heads, a 2 x 3 x 5 grid, 7 text tokens
    "h3d40": Case(heads=3, head_dim=40, layers=1, batch=1, frames=2, hw=(6, 10), text=7),
    # head_dim 128 (Wan2.1's, 22/21/21), diffusers' fused q/k/v and k/v projections
    "h1d128_fused": Case(heads=1, head_dim=128, layers=1, batch=1, frames=4, hw=(4, 6), text=5, fused=True),
}


def wan_transformer(heads: int, head_dim: int, layers: int, seed: int = 0, **extra) -> torch.nn.Module:
    """A diffusers WanTransformer3DModel (4 latent channels, text_dim 32) with randomised weights, eval mode.

    Every tensor is drawn at a scale where each branch (self-attention, cross-attention, FFN, head) moves
    the output by O(1), so a wrong rotation, head split or key/value mix-up cannot hide."""
    torch.manual_seed(seed)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=64,
        ffn_dim=96,
        num_layers=layers,
        **extra,
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn_like(p)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * r)
            elif "scale_shift_table" in name:
                p.copy_(0.5 * r)
            elif p.ndim > 1:
                p.copy_(r / p[0].numel() ** 0.5)
            else:
                p.copy_(0.1 * r)
    return model.eval()


def _inputs(case: Case, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(case.batch, 4, case.frames, *case.hw, generator=g)
    t = torch.tensor([952.381, 555.556][: case.batch])
    text = torch.randn(case.batch, case.text, 32, generator=g)
    return x, t, text


def _model(case: Case) -> torch.nn.Module:
    m = wan_transformer(case.heads, case.head_dim, case.layers)
    if case.fused:
        m.fuse_qkv_projections()
    return m


def _run(model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    dt = next(p.dtype for n, p in model.named_parameters() if "patch_embedding" in n)
    with torch.no_grad():
        return model(x.to(dt), t, text.to(dt), return_dict=False)[0]


def _keep_fp32_like_from_pretrained(model: torch.nn.Module) -> torch.nn.Module:
    """bf16 with diffusers' ``_keep_in_fp32_modules`` (rope, time embedder, norms) back in fp32: the mix
    ``from_pretrained(torch_dtype=torch.bfloat16)`` loads (which needs accelerate, not in the test extra)."""
    keep = set(model._keep_in_fp32_modules)
    model.to(torch.bfloat16)
    for name, mod in model.named_modules():
        if keep & set(name.split(".")):
            mod.float()
    return model


def _baseline(model: torch.nn.Module, x, t, text) -> torch.Tensor:
    return _run(copy.deepcopy(model).double(), x.double(), t.double(), text.double())


# ------------------------------------------------------------------------------ against diffusers


@pytest.mark.parametrize("name", sorted(CASES))
def test_fp32_model_matches_diffusers_forward(name: str) -> None:
    case = CASES[name]
    model = _model(case)
    x, t, text = _inputs(case)
    base = _baseline(model, x, t, text)
    ref_err = numerics.max_abs_err(_run(model, x, t, text), base)
    installed = install_nki_attention(model, backend="reference")
    assert sorted(installed) == sorted(f"blocks.{i}.attn{j}" for i in range(case.layers) for j in (1, 2))
    got = _run(model, x, t, text)
    numerics.assert_within(got, base, torch.float32, ref_err, f"{name}: NKI processor vs diffusers fp64")


@pytest.mark.parametrize("cast", ["to_bf16", "keep_fp32_modules"])
def test_bf16_model_matches_diffusers_forward(cast: str) -> None:
    """bf16 weights and activations: all of them (``.to(torch.bfloat16)``, rotary tables too) or the
    from_pretrained mix (rotary tables, time embedder and norms in fp32)."""
    case = CASES["h2d64"]
    model = _model(case)
    x, t, text = _inputs(case)
    base = _baseline(model, x, t, text)
    model = model.to(torch.bfloat16) if cast == "to_bf16" else _keep_fp32_like_from_pretrained(model)
    want = _run(model, x, t, text)
    ref_err = numerics.max_abs_err(want, base)
    assert want.dtype == torch.bfloat16 and ref_err > 0
    install_nki_attention(model, backend="reference")
    got = _run(model, x, t, text)
    numerics.assert_within(
        got, base, torch.bfloat16, ref_err, f"{cast}: bf16 NKI processor vs diffusers fp64"
    )


@pytest.mark.emulator
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emulator_backend_matches_diffusers_forward(dtype: torch.dtype) -> None:
    """The NKI kernels themselves (rope3d_tables and attention on the emulator), one layer."""
    case = Case(heads=2, head_dim=64, layers=1, batch=1, frames=2, hw=(8, 8), text=6)
    model = _model(case)
    x, t, text = _inputs(case)
    base = _baseline(model, x, t, text)
    model = model.to(dtype)
    ref_err = numerics.max_abs_err(_run(model, x, t, text), base)
    install_nki_attention(model, backend="emulator")
    numerics.assert_within(_run(model, x, t, text), base, dtype, ref_err, f"emulator {dtype}")


def test_rotary_tables_are_the_projects_own() -> None:
    """diffusers' rope module hands the processor exactly the fp32 tables ``ops.rope_tables`` builds for
    the token grid (the kernels' operand), so the processor rotates by the project's own angles."""
    for case in CASES.values():
        model = _model(case)
        x, _, _ = _inputs(case)
        cos, sin = model.rope(x)
        want_cos, want_sin = ops.rope_tables(case.grid, case.head_dim, dtype=torch.float32)
        assert torch.equal(cos[0, :, 0, 0::2], want_cos) and torch.equal(sin[0, :, 0, 1::2], want_sin)


@pytest.mark.parametrize("module, fused", [("attn1", False), ("attn1", True), ("attn2", True)])
def test_attention_without_rotary_or_text_matches_diffusers_processor(module: str, fused: bool) -> None:
    """A call with ``rotary_emb=None`` and no ``encoder_hidden_states`` is diffusers' plain attention over
    hidden_states (no rotation); with fused projections the module's kind picks the fused weight, as in
    diffusers (a cross-attention module called alone projects q with ``to_q`` and k/v with ``to_kv``)."""
    model = wan_transformer(2, 64, 1)
    if fused:
        model.fuse_qkv_projections()
    attn = getattr(model.blocks[0], module)
    hs = torch.randn(2, 24, 128, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = copy.deepcopy(attn).double()(hs.double())
        want = attn(hs)
        attn.set_processor(NkiWanAttnProcessor(f"blocks.0.{module}", "reference"))
        got = attn(hs)
    numerics.assert_within(
        got, base, torch.float32, numerics.max_abs_err(want, base), f"{module} fused={fused} without rope"
    )


def test_backward_cross_attention_has_diffusers_gradient_self_attention_refuses() -> None:
    """Inference is the processor's scope: the rope op has no backward (RuntimeError naming it, not a
    silent zero gradient); cross-attention (no rope) back-propagates through ``ops.attention``'s backward,
    to diffusers' gradient within the rule (baseline: diffusers' float64 gradient)."""
    model = wan_transformer(2, 64, 1)
    g = torch.Generator().manual_seed(5)
    x, enc = torch.randn(1, 4, 1, 4, 4, generator=g), torch.randn(1, 3, 128, generator=g)
    hs = torch.randn(1, 4, 128, generator=g)

    def grad(m: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
        h = hs.to(dtype).requires_grad_(True)
        (m.blocks[0].attn2(h, enc.to(dtype)) ** 2).sum().backward()
        assert h.grad is not None
        return h.grad

    base = grad(copy.deepcopy(model).double(), torch.float64)
    want = grad(model, torch.float32)
    install_nki_attention(model, backend="reference")
    numerics.assert_within(
        grad(model, torch.float32), base, torch.float32, numerics.max_abs_err(want, base), "attn2 grad"
    )
    h = hs.clone().requires_grad_(True)
    out = model.blocks[0].attn1(h, rotary_emb=model.rope(x))
    with pytest.raises(RuntimeError, match=r"backward through nki_ardiff\.rope3d_tables"):
        out.sum().backward()


def test_compiles_to_one_graph_with_the_ops_inside() -> None:
    """``torch.compile(fullgraph=True)``: one graph, no break, no recompile; the custom ops are its nodes
    (one rope3d_tables per layer, two attentions); the captured graph gives the eager output."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    case = CASES["h3d40"]
    model = _model(case)
    install_nki_attention(model, backend="reference")
    x, t, text = _inputs(case)
    eager = _run(model, x, t, text)
    graphs: list[torch.fx.GraphModule] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend=counting_backend)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = [_run(compiled, x, t, text) for _ in range(2)]
    assert len(graphs) == 1 and counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"], dict(counters["graph_break"])
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count("nki_ardiff.rope3d_tables.default") == case.layers
    assert targets.count("nki_ardiff.attention.default") == 2 * case.layers
    assert not any("scaled_dot_product" in s for s in targets)
    assert all(torch.equal(g, eager) for g in got)


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("module", ["attn1", "attn2"])
def test_attention_mask_is_refused_naming_the_module(module: str) -> None:
    """Even an all-true mask (which would not change the result): the processor never drops a mask."""
    model = wan_transformer(2, 64, 1)
    install_nki_attention(model)
    attn = getattr(model.blocks[0], module)
    hs = torch.randn(1, 8, 128)
    enc = torch.randn(1, 5, 128) if module == "attn2" else None
    mask = torch.ones(1, 8, 5 if module == "attn2" else 8, dtype=torch.bool)
    with pytest.raises(ValueError, match=rf"^blocks\.0\.{module}: attention_mask is not supported"):
        attn(hs, enc, attention_mask=mask)


def test_key_value_head_size_other_than_the_querys_is_refused() -> None:
    """``cross_attention_dim_head`` != the query's head size: refused at install and, when the processor
    is set by hand, at the call; both name the module."""
    from diffusers.models.transformers.transformer_wan import WanAttention

    odd = WanAttention(dim=128, heads=2, dim_head=64, cross_attention_dim_head=32)
    model = torch.nn.ModuleDict({"wan": wan_transformer(1, 64, 1), "odd": odd})
    with pytest.raises(ValueError, match=r"^odd \(WanAttention\): key/value width 64 != query width 128"):
        install_nki_attention(model)
    odd.set_processor(NkiWanAttnProcessor("odd", "reference"))
    with pytest.raises(ValueError, match=r"^odd \(WanAttention\): key/value width 64"):
        odd(torch.randn(1, 4, 128), torch.randn(1, 3, 128))


def test_image_cross_attention_is_refused_at_install_and_nothing_changes() -> None:
    """Wan I2V (``image_dim`` + ``added_kv_proj_dim``): refused before any processor is replaced."""
    model = wan_transformer(2, 64, 2, image_dim=16, added_kv_proj_dim=16)
    before = {k: type(v) for k, v in model.attn_processors.items()}
    with pytest.raises(ValueError, match=r"^blocks\.0\.attn2 \(WanAttention\): image cross-attention"):
        install_nki_attention(model)
    assert {k: type(v) for k, v in model.attn_processors.items()} == before
    assert set(before.values()) == {WanAttnProcessor}


def test_a_diffusers_attention_backend_set_later_is_refused() -> None:
    model = wan_transformer(2, 64, 1)
    install_nki_attention(model)
    model.blocks[0].attn1.set_attention_backend("native")
    x, t, text = _inputs(CASES["h2d64"])
    with pytest.raises(ValueError, match=r"^blocks\.0\.attn1: a diffusers attention backend"):
        _run(model, x[:1, :, :1], t[:1], text[:1])


def test_a_context_parallel_config_set_later_is_refused() -> None:
    """diffusers' ``enable_parallelism`` writes ``_parallel_config`` on every processor (it needs a
    process group, so the attribute is written here as diffusers writes it)."""
    model = wan_transformer(2, 64, 1)
    procs = install_nki_attention(model)
    procs["blocks.0.attn1"]._parallel_config = object()
    with pytest.raises(ValueError, match=r"^blocks\.0\.attn1: diffusers context parallelism"):
        model.blocks[0].attn1(torch.randn(1, 4, 128))


class _Untouchable(torch.nn.Module):
    """Stands in for a projection that must not run: the input is refused before it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a projection ran before the input was checked")


def test_malformed_activations_are_refused_before_any_projection() -> None:
    model = wan_transformer(2, 64, 1)
    install_nki_attention(model)
    for attn in (model.blocks[0].attn1, model.blocks[0].attn2):
        attn.to_q = attn.to_k = attn.to_v = _Untouchable()
    with pytest.raises(ValueError, match=r"^blocks\.0\.attn1: hidden_states must be a \[B, L, dim\] tensor"):
        model.blocks[0].attn1(torch.randn(4, 128))
    with pytest.raises(ValueError, match=r"^blocks\.0\.attn2: encoder_hidden_states must be \[B, Lt, dim\]"):
        model.blocks[0].attn2(torch.randn(2, 4, 128), torch.randn(1, 3, 128))
    with pytest.raises(ValueError, match=r"^blocks\.0\.attn1: rotary_emb must be .* got \[\(\(1, 5, 1, 64\)"):
        model.blocks[0].attn1(torch.randn(1, 4, 128), rotary_emb=(torch.ones(1, 5, 1, 64),) * 2)


def test_float16_is_refused_naming_the_module() -> None:
    model = wan_transformer(2, 64, 1).to(torch.float16)
    install_nki_attention(model)
    with pytest.raises(TypeError, match=r"^blocks\.0\.attn1: hidden_states dtype torch.float16"):
        model.blocks[0].attn1(torch.randn(1, 4, 128, dtype=torch.float16))


def test_unknown_processor_arguments_and_odd_rotary_are_refused() -> None:
    model = wan_transformer(2, 64, 1)
    install_nki_attention(model)
    attn, hs = model.blocks[0].attn1, torch.randn(1, 4, 128)
    with pytest.raises(TypeError, match=r"^blocks\.0\.attn1: unexpected processor argument\(s\) \['scale'\]"):
        attn(hs, scale=2.0)
    complex_freqs = torch.polar(torch.ones(1, 1, 4, 32), torch.zeros(1, 1, 4, 32))  # diffusers < 0.35's form
    with pytest.raises(ValueError, match=r"^blocks\.0\.attn1: rotary_emb must be diffusers' \(cos, sin\)"):
        attn(hs, rotary_emb=complex_freqs)
    with pytest.raises(ValueError, match=r"^blocks\.0\.attn2: rotary_emb was passed to a cross-attention"):
        model.blocks[0].attn2(hs, hs, rotary_emb=(torch.ones(1, 4, 1, 64), torch.zeros(1, 4, 1, 64)))


def test_install_checks_its_arguments() -> None:
    model = wan_transformer(1, 160, 1)  # head_dim 160: beyond the kernels' 128 partitions
    with pytest.raises(ValueError, match=r"^blocks\.0\.attn1 \(WanAttention\): head_dim 160 > 128"):
        install_nki_attention(model, backend="emulator")
    assert install_nki_attention(model, backend="reference")  # the reference backend takes any head_dim
    with pytest.raises(ValueError, match=r"^backend must be one of"):
        install_nki_attention(model, backend="cuda")
    with pytest.raises(TypeError, match=r"^model must be a torch.nn.Module"):
        install_nki_attention("transformer")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"has no diffusers WanAttention module"):
        install_nki_attention(torch.nn.Linear(2, 2))
    from diffusers.models.attention_processor import Attention

    other = torch.nn.ModuleDict({"wan": wan_transformer(1, 64, 1), "sd": Attention(query_dim=8, heads=1)})
    with pytest.raises(ValueError, match=r"^sd \(Attention\): only diffusers WanAttention modules"):
        install_nki_attention(other)
    assert not any(isinstance(p, NkiWanAttnProcessor) for p in other["wan"].attn_processors.values())


# ------------------------------------------------------------------------------ the overhead benchmark


def test_overhead_benchmark_rows() -> None:
    """``perf.bench_integrations`` (docs/integrate.md's measured overhead) on its toy preset: one measured
    row per call and processor, the NKI row's ratio is the two medians' and its output is the model's."""
    from perf import bench_integrations as bench

    rows = bench.measure("quick", "float32", rounds=1, warmup=1)
    assert [(r.op, r.variant) for r in rows] == [
        (op, v)
        for op in ("wan_attn1", "wan_attn2", "wan_forward", "attention_math")
        for v in ("diffusers", "nki_reference")
    ]
    assert all(r.status == "ok" and r.kind == "measured" and r.latency_us for r in rows)
    for base, ours in zip(rows[::2], rows[1::2]):
        assert ours.extra["overhead_x"] == pytest.approx(ours.latency_us / base.latency_us, rel=1e-12)
        assert 0 < ours.extra["max_abs_diff"] < numerics.FP32_ISSUE_BOUND  # two fp32 sums of one model
    assert len(bench.summary(rows)) == 4


def docs_example(name: str) -> str:
    """The ```python block after ``<!-- example: name -->`` in docs/integrate.md (its runnable code)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "integrate.md").read_text()
    marker = f"<!-- example: {name} -->\n```python\n"
    assert text.count(marker) == 1, f"docs/integrate.md has no single {marker!r}"
    start = text.index(marker) + len(marker)
    return text[start : text.index("\n```\n", start)]


def test_docs_processor_example_runs_and_says_what_it_prints() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(docs_example("processor"), "docs/integrate.md:processor", "exec"), {})
    first, second = out.getvalue().splitlines()
    assert first == "['blocks.0.attn1', 'blocks.0.attn2', 'blocks.1.attn1', 'blocks.1.attn2']"
    assert second.startswith("max |NKI - diffusers| = ")
    assert 0 < float(second.rsplit(" ", 1)[1]) < numerics.FP32_ISSUE_BOUND  # the page says "below 1e-5"
