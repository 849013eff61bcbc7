"""SDP4BitStrategy with compression off (preset "baseline") against DDPStrategy, the oracle, on
CPU processes: fp32 bit-exact on 2 ranks (AdamW with two groups, a per-step LR schedule,
accumulation 2, clip 1.0 configured), with optimizer state per rank 1/world of DDP's; on 4
ranks, with clipping engaged, within the bounds that a different summation order allows;
bf16-true within a stated tolerance over 20 steps."""

import torch
from distributed import run_workers
from lightning_runs import ddp, make_trainer, sdp4bit, weights
from models import TinyLMModule

# A sum of W fp32 terms in another order differs by at most 2 (W - 1) u sum|g| (u = 2^-24);
# relative to the gradient's norm that stays below 1e-6 for W = 4 and these gradients.
SUMMATION_ORDER_RTOL = 1e-6


def _fit_both(rank, world, steps, module_kwargs, trainer_kwargs):
    out = {}
    for name, strategy in (("ddp", ddp()), ("sdp4bit", sdp4bit(preset="baseline"))):
        module = TinyLMModule(**module_kwargs)
        trainer = make_trainer(world, strategy, max_steps=steps, accumulate_grad_batches=2, **trainer_kwargs)
        trainer.fit(module)
        optimizer = trainer.strategy.optimizers[0]
        state = sum(t.numel() for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
        out[name] = {"weights": weights(module), "optimizer_state_numel": state}
        if name == "sdp4bit":
            out["shard_numel"] = sum(b.layout.shard_numel for b in trainer.strategy.engine.buckets)
            out["buckets"] = len(trainer.strategy.engine.buckets)
    return out


def test_fp32_baseline_equals_ddp_bit_for_bit_on_two_ranks():
    # loss_scale keeps the global gradient norm under 1, so clip 1.0 runs but scales by exactly 1.
    results = run_workers(_fit_both, 2, 6, {"loss_scale": 0.05}, {"gradient_clip_val": 1.0})
    for rank_result in results:
        for name, expected in rank_result["ddp"]["weights"].items():
            assert torch.equal(rank_result["sdp4bit"]["weights"][name], expected), name
    ours = results[0]["sdp4bit"]["weights"]
    assert all(torch.equal(ours[n], w) for n, w in results[1]["sdp4bit"]["weights"].items())
    _check_optimizer_state_is_sharded(results)


def _check_optimizer_state_is_sharded(results):
    """Optimizer state per rank is 1/world of DDP's (AdamW: two tensors per parameter element)."""
    world = len(results)
    ddp_size = results[0]["ddp"]["optimizer_state_numel"]
    shard_numel, buckets = results[0]["shard_numel"], results[0]["buckets"]
    # The fragments partition the parameters: together the ranks hold exactly DDP's state...
    assert sum(r["sdp4bit"]["optimizer_state_numel"] for r in results) == ddp_size
    # ...and each at most its shards' worth, a shard being 1/world of a bucket padded to whole
    # 32-element units.
    assert 0 <= shard_numel * world - ddp_size // 2 < world * 32 * buckets
    assert max(r["sdp4bit"]["optimizer_state_numel"] for r in results) <= 2 * shard_numel


def _first_step_grads(rank, world, clip, ranks_per_node=None):
    """Each strategy's averaged gradient at the first optimizer step, by parameter name, and the
    weights after that step (same data, same starting weights)."""
    from lightning.pytorch.callbacks import Callback

    class Grab(Callback):
        def __init__(self):
            self.grads = {}

        def on_before_optimizer_step(self, trainer, module, optimizer):
            engine = getattr(trainer.strategy, "engine", None)
            if engine is None:
                self.grads = {n: p.grad.detach().clone() for n, p in module.model.named_parameters()}
                return
            for name, records in engine.fragments_by_name.items():
                for record in records:
                    frag = record.fragment
                    self.grads[name.removeprefix("model.")] = (frag.param_start, record.grad.clone())

    out = {}
    nodes = {} if ranks_per_node is None else {"ranks_per_node": ranks_per_node}
    for name, strategy in (("ddp", ddp()), ("sdp4bit", sdp4bit(preset="baseline", **nodes))):
        grab = Grab()
        module = TinyLMModule()
        trainer = make_trainer(
            world, strategy, max_steps=1, accumulate_grad_batches=2, callbacks=[grab], gradient_clip_val=clip
        )
        trainer.fit(module)
        out[name] = {"grads": grab.grads, "weights": weights(module)}
    return out


def test_reduced_gradients_and_clipped_step_agree_within_summation_order_on_four_ranks():
    _assert_agree_within_summation_order(run_workers(_first_step_grads, 4, 1.0))


def test_the_two_level_uncompressed_path_agrees_with_ddp_on_two_nodes_of_two():
    """With 2 nodes x 2 the uncompressed reduce-scatter goes inside the node, then across nodes,
    and the all-gather the other way round: the same gradients and weights as DDP's, up to the
    order of the sums."""
    _assert_agree_within_summation_order(run_workers(_first_step_grads, 4, 1.0, 2))


def _assert_agree_within_summation_order(results):
    for rank_result in results:
        full = rank_result["ddp"]["grads"]
        for name, (start, shard) in rank_result["sdp4bit"]["grads"].items():
            expected = full[name].reshape(-1)[start : start + shard.numel()]
            # Clipping engages here (global norm ~7 > 1): both sides scale by the same coefficient
            # up to the norm's own summation order.
            assert torch.allclose(shard, expected, rtol=0, atol=SUMMATION_ORDER_RTOL * full[name].norm().item() + 1e-12)
        for name, w in rank_result["ddp"]["weights"].items():
            # After one AdamW step (lr 1e-2) the weights differ by at most a few ulps.
            assert torch.allclose(rank_result["sdp4bit"]["weights"][name], w, rtol=0, atol=1e-6), name


def _losses(rank, world, runs, steps):
    out = []
    for name, precision in runs:
        module = TinyLMModule(lr=3e-3)
        losses: list[float] = []
        module.on_train_batch_end = lambda outputs, batch, idx, losses=losses: losses.append(float(outputs["loss"]))
        strategy = ddp() if name == "ddp" else sdp4bit(preset="baseline")
        make_trainer(world, strategy, max_steps=steps, accumulate_grad_batches=2, precision=precision).fit(module)
        out.append(losses)
    return out


# Tolerances of the bf16 test. Ours keeps fp32 master weights and optimizer state, so it differs
# from the fp32 run only by bf16 forward/backward rounding: within 1% of its loss at every
# micro-batch. DDP under bf16-true keeps bf16 weights *and* bf16 optimizer state and drifts
# further (6-7% by step 20 here), so against it the tolerance is 10%.
def test_bf16_true_stays_close_to_ddp_over_twenty_steps():
    runs = [("ddp", "32-true"), ("ddp", "bf16-true"), ("sdp4bit", "bf16-true")]
    ddp_fp32, ddp_bf16, ours = run_workers(_losses, 2, runs, 20)[0]
    assert len(ours) == 40 and ours[-1] < 0.6 * ours[0]
    for reference, candidate, tolerance in ((ddp_fp32, ours, 0.01), (ddp_bf16, ours, 0.10)):
        for a, b in zip(reference, candidate, strict=True):
            assert abs(a - b) <= tolerance * abs(a), (a, b)
