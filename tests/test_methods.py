"""Every method through the one driver: each sequential method against its independent reference loop
(reference/sequential.py) and the method descriptions' constants and refusals."""

from __future__ import annotations

import pytest
import torch

from reference.sequential import sequential_reference
from rolling_forcing import sequential
from rolling_forcing.config import PipelineConfig, get_preset
from rolling_forcing.methods import METHOD_NAMES, METHODS, StreamMethod, get_method
from rolling_forcing.model import CausalWanModel
from rolling_forcing.pipeline import RollingForcingPipeline
from tests.numerics import FP32_ISSUE_BOUND  # the fp32 stream-equivalence bound (1e-5)
from tests.pipeline_helpers import one_thread as one_thread  # autouse: one intra-op thread
from tests.pipeline_helpers import text_embeds, tiny_model

M = get_preset("tiny")
P = PipelineConfig()


@pytest.fixture(scope="module")
def model() -> CausalWanModel:
    return tiny_model(M)


def _drive(
    model: CausalWanModel,
    method: str,
    nb: int,
    positions: str,
    switch_after: int | None = None,
    merged: bool | None = None,
    stats: dict | None = None,
    **kw: object,
) -> torch.Tensor:
    pipe = RollingForcingPipeline(model, M, P, method=method, positions=positions, merged=merged, **kw)  # type: ignore[arg-type]
    out = []
    for c in pipe.stream(text_embeds(), nb, generator=torch.Generator().manual_seed(7)):
        assert c.final and c.block == len(out)
        out.append(c.latents)
        if switch_after is not None and c.block == switch_after:
            pipe.set_prompt(text_embeds(99), recache=True)
    if stats is not None:
        stats.update(pipe.stats.forwards)
        stats["_signatures"] = {k for k, _ in pipe.stats.signatures.elements()}
        stats["_n_signatures"] = len(pipe.stats.signatures)
    return torch.cat(out, dim=1)


def _reference(
    model: CausalWanModel, method: str, nb: int, switch_after: int | None = None, **kw: object
) -> torch.Tensor:
    m = METHODS[method]
    g = torch.Generator().manual_seed(7)
    noise = torch.randn(1, nb * 3, *M.latent_frame_shape(), generator=g)  # up front, as the originals
    sig, ts = m.scheduler_table()
    switches = {} if switch_after is None else {(switch_after + 1) * 3: text_embeds(99)}
    with torch.no_grad():
        return sequential_reference(
            model, text_embeds(), noise, denoising_timesteps=m.timesteps, sigmas=sig, timesteps=ts,
            tokens_per_frame=M.tokens_per_frame, num_heads=M.num_heads, generator=g,
            switches=switches, **kw,  # type: ignore[arg-type]
        )  # fmt: skip


# (method, positions, blocks, reference loop settings, switch after block): absolute Self-Forcing and
# CausVid fill their 21-frame cache (7 blocks); relative runs past it with the original's rolling option
# (local window 21 frames), evicting 3 times; LongLive evicts from block 4 on and switches the prompt at
# block 6 (re-cache of blocks 3..5 with the sink protected) or at block 2 (re-cache of blocks 0..1, the
# sink re-written); LongLive relative is its "infinity" cache (positions = buffer frame index), which
# differs from absolute once the window moves away from the sink.
CASES = [
    ("self-forcing", "absolute", 7, {}, None),
    ("self-forcing", "relative", 10, {"local_attn_frames": 21}, None),
    ("causvid", "absolute", 7, {}, None),
    ("causvid", "relative", 10, {"local_attn_frames": 21}, None),
    ("longlive", "absolute", 9, {"local_attn_frames": 12, "sink_frames": 3, "recache_frames": 12}, 5),
    ("longlive", "absolute", 6, {"local_attn_frames": 12, "sink_frames": 3, "recache_frames": 12}, 1),
    (
        "longlive",
        "relative",
        9,
        {"local_attn_frames": 12, "sink_frames": 3, "recache_frames": 12, "relative_positions": True},
        5,
    ),
]


@pytest.mark.parametrize(("method", "positions", "nb", "ref_kw", "switch"), CASES)
def test_method_equals_reference_loop(
    model: CausalWanModel, method: str, positions: str, nb: int, ref_kw: dict, switch: int | None
) -> None:
    """fp32, tiny model: the driver's stream equals the method's reference loop within the fp32
    stream-equivalence bound
    (measured: absolute ~1e-6 from partial-attention merging; relative adds RoPE rounding)."""
    got = _drive(model, method, nb, positions, switch)
    ref = _reference(model, method, nb, switch, **ref_kw)
    assert got.shape == ref.shape
    assert float(ref.abs().max()) > 0.1  # a real signal
    err = float((got - ref).abs().max())
    assert err <= FP32_ISSUE_BOUND, err


@pytest.mark.parametrize(
    ("method", "positions", "nb", "switch"),
    [("self-forcing", "absolute", 7, None), ("causvid", "relative", 9, None), ("longlive", "absolute", 8, 4)],
)
def test_batched_update_equals_two_pass(
    model: CausalWanModel, method: str, positions: str, nb: int, switch: int | None
) -> None:
    """merged=True batches each block's cache update with the next block's first denoise call: the
    same stream within the fp32 equivalence bound (measured <= 2e-6, fp32 reordering), one forward fewer
    per block
    (an update before a prompt switch runs alone; the last block's update, never read, is not run)."""
    two_stats: dict = {}
    one_stats: dict = {}
    two = _drive(model, method, nb, positions, switch, merged=False, stats=two_stats)
    one = _drive(model, method, nb, positions, switch, merged=True, stats=one_stats)
    err = float((two - one).abs().max())
    assert err <= FP32_ISSUE_BOUND, err
    steps, n_sw = METHODS[method].steps, int(switch is not None)
    two_stats.pop("_signatures"), two_stats.pop("_n_signatures")
    assert two_stats == {"denoise": nb * steps, "update": nb, **({"recache": 1} if n_sw else {})}
    assert one_stats.get("batched") == nb - 1 - n_sw and one_stats.get("update", 0) == n_sw
    assert one_stats["denoise"] == nb * steps - (nb - 1 - n_sw)


@pytest.mark.parametrize(
    ("method", "positions", "nb", "switch"),
    [("self-forcing", "absolute", 7, None), ("causvid", "relative", 9, None), ("longlive", "relative", 8, 4)],
)
def test_static_stream_one_signature_equals_two_pass(
    model: CausalWanModel, method: str, positions: str, nb: int, switch: int | None
) -> None:
    """static=True: every call is one rolling_forcing.merged.merged_forward of [held-back update (masked
    when none) + the block to denoise] with index tensors: one input signature for the whole stream
    (a switch adds its eager update-alone and re-cache passes), equal to the two-pass stream within
    the fp32 equivalence bound (measured <= 1.9e-6)."""
    two = _drive(model, method, nb, positions, switch, merged=False)
    st: dict = {}
    one = _drive(model, method, nb, positions, switch, stats=st, static=True)
    assert float((two - one).abs().max()) <= FP32_ISSUE_BOUND
    n_sw = int(switch is not None)
    assert st["static"] == nb * METHODS[method].steps
    assert st.get("update", 0) == n_sw and st.get("recache", 0) == n_sw
    assert st["_n_signatures"] == 1 + 2 * n_sw  # one static signature (+ the switch's two passes)


def test_static_stream_compiles_to_one_graph(model: CausalWanModel) -> None:
    """LongLive static (relative, 8 blocks, eviction): torch.compile(fullgraph=True) captures one graph,
    no graph break, no recompilation across the stream (a counting backend runs the captured graph)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    compiles: list[int] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        compiles.append(len(gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _drive(model, "longlive", 8, "relative", static=True, compile=counting_backend)
    assert len(compiles) == 1, compiles
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert float((got - _drive(model, "longlive", 8, "relative")).abs().max()) <= FP32_ISSUE_BOUND


def test_longlive_switch_changes_the_stream(model: CausalWanModel) -> None:
    """The re-cache matters: the switched stream differs from the unswitched one after the switch only,
    and from a switch without re-cache (the reference loop with recache_frames=None)."""
    kw = {"local_attn_frames": 12, "sink_frames": 3}
    sw = _drive(model, "longlive", 8, "absolute", 4)
    no_recache = _reference(model, "longlive", 8, 4, **kw)
    plain = _drive(model, "longlive", 8, "absolute")
    assert torch.equal(sw[:, :15], plain[:, :15])
    assert float((sw[:, 15:] - plain[:, 15:]).abs().max()) > 1e-3
    assert float((sw[:, 15:] - no_recache[:, 15:]).abs().max()) > 1e-3


def test_method_constants() -> None:
    """The published loops' constants (Self-Forcing/LongLive warped steps, CausVid raw steps, windows)."""
    sf, cv, ll, rf = (METHODS[n] for n in ("self-forcing", "causvid", "longlive", "rolling-forcing"))
    assert sf.timesteps == pytest.approx((1000.0, 937.5, 833.3333, 625.0), abs=1e-3)
    assert ll.timesteps == sf.timesteps and ll.attention_frames == 12 and ll.sink_blocks == 1
    assert cv.timesteps == (1000.0, 757.0, 522.0) and cv.timestep_shift == 8.0
    assert sf.attention_frames == cv.attention_frames == rf.attention_frames == 21
    assert rf.timesteps == P.timesteps and rf.pipeline_config() == P
    assert sf.max_blocks("absolute") == 7 and ll.max_blocks("absolute") == 341
    assert sf.max_blocks("relative") is None


def test_sequential_key_sets() -> None:
    """LongLive: sink + at most 2 previous blocks + itself; a re-cache after block 4 writes the last 3."""
    ll, sf = METHODS["longlive"], METHODS["self-forcing"]
    assert [sequential.key_blocks(ll, b) for b in range(6)] == [
        (0,), (0, 1), (0, 1, 2), (0, 1, 2, 3), (0, 2, 3, 4), (0, 3, 4, 5),
    ]  # fmt: skip
    assert sequential.key_blocks(sf, 9) == (3, 4, 5, 6, 7, 8, 9)
    rp = sequential.recache_plan(ll, 7, "absolute")
    assert rp is not None and rp.blocks == (4, 5, 6) and [k.block for k in rp.pass_.cache_keys] == [0]
    rp2 = sequential.recache_plan(ll, 3, "absolute")
    assert rp2 is not None and rp2.blocks == (0, 1, 2) and rp2.pass_.cache_keys == ()


def test_bad_method_input(model: CausalWanModel) -> None:
    with pytest.raises(ValueError, match="method must be one of"):
        get_method("diffusion-forcing")
    with pytest.raises(
        ValueError, match="compile= applies to Rolling Forcing's merged forward only, not method='longlive'"
    ):
        RollingForcingPipeline(model, M, P, method="longlive", merged=True, compile=True)
    with pytest.raises(ValueError, match="at most 7 blocks"):
        next(RollingForcingPipeline(model, M, P, method="self-forcing").stream(text_embeds(), 8))
    with pytest.raises(ValueError, match="does not match pipe_cfg"):
        RollingForcingPipeline(model, M, PipelineConfig(context_blocks=2), method="rolling-forcing")
    with pytest.raises(ValueError, match="static=True is for sequential methods"):
        RollingForcingPipeline(model, M, P, static=True)
    with pytest.raises(ValueError, match="needs merged=True or None"):
        RollingForcingPipeline(model, M, P, method="causvid", static=True, merged=False)
    with pytest.raises(ValueError, match="has no KV re-cache"):
        RollingForcingPipeline(model, M, P, method="causvid").set_prompt(text_embeds(9), recache=True)
    with pytest.raises(ValueError, match="sink_positions"):
        StreamMethod("x", 3, (1000,), 5.0, True, 1, 1, "none", 4)


@pytest.mark.parametrize("sink", [0, 1])
def test_sequential_method_needs_a_ring_slot(sink: int) -> None:
    """The edge exactly: a budget of the sink alone (no ring slot for the pass's own block; slot_of would
    divide by 0) is refused at construction; one block more is the smallest method that runs."""
    pos = "fixed" if sink else "none"
    if sink:
        with pytest.raises(
            ValueError, match=r"attention_blocks=1 must hold the sink \(1\) and the pass's own block"
        ):
            StreamMethod("x", 3, (1000,), 5.0, True, 1, sink, pos, sink)
    else:
        with pytest.raises(ValueError, match="attention_blocks must be >= 1, got 0"):
            StreamMethod("x", 3, (1000,), 5.0, True, 1, sink, pos, sink)
    m = StreamMethod("x", 3, (1000,), 5.0, True, 1, sink, pos, sink + 1)
    assert m.ring_slots == 1 and m.buffer_slots == sink + 1
    assert sequential.key_blocks(m, 5) == (*range(sink), 5)  # the sink (if any) and the block itself
    assert set(METHOD_NAMES) == {"rolling-forcing", "self-forcing", "causvid", "longlive"}
