"""Train the demo target: a small DeepSeek-V3-architecture MoE (transformers' DeepseekV3ForCausalLM).

MLA attention (q_lora_rank, kv_lora_rank, decoupled rope dims), the first layer dense
(first_k_dense_replace=1), then routed experts with sigmoid ``noaux_tc`` routing (n_group/topk_group,
e_score_correction_bias) and a shared expert. The correction bias is trained the DeepSeek-V3 way
(auxiliary-loss-free balancing): after every step, bias_e += gamma * sign(mean_load - load_e).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.train.common import (
    Logger,
    Progress,
    Schedule,
    TrainError,
    autocast,
    folder_size_bytes,
    make_optimizer,
)
from specserve.train.data import WindowSampler, eval_windows
from specserve.train.tokenizer import EOS_ID


@dataclass(frozen=True)
class TargetSpec:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 5
    num_heads: int = 4
    q_lora_rank: int = 128
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    intermediate_size: int = 768  # the dense first layer
    moe_intermediate_size: int = 64  # each routed expert and the shared expert
    n_routed_experts: int = 16
    num_experts_per_tok: int = 4
    n_group: int = 4
    topk_group: int = 2
    n_shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise TrainError(f"TargetSpec.{name} must be > 0, got {value}")
        if self.n_routed_experts % self.n_group:
            raise TrainError(f"n_routed_experts {self.n_routed_experts} not divisible by n_group {self.n_group}")
        if self.n_routed_experts // self.n_group < 2:
            raise TrainError("noaux_tc group scores sum the top-2 experts of a group: need >= 2 experts per group")
        if self.topk_group > self.n_group:
            raise TrainError(f"topk_group {self.topk_group} > n_group {self.n_group}")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise TrainError("num_experts_per_tok exceeds the experts in topk_group groups")
        if self.num_layers < 2:
            raise TrainError("need >= 2 layers (one dense, then MoE)")

    def hf_config(self):
        from transformers import DeepseekV3Config

        return DeepseekV3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads,
            n_shared_experts=self.n_shared_experts,
            n_routed_experts=self.n_routed_experts,
            routed_scaling_factor=self.routed_scaling_factor,
            kv_lora_rank=self.kv_lora_rank,
            q_lora_rank=self.q_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            qk_nope_head_dim=self.qk_nope_head_dim,
            n_group=self.n_group,
            topk_group=self.topk_group,
            num_experts_per_tok=self.num_experts_per_tok,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            bos_token_id=EOS_ID,
            eos_token_id=EOS_ID,
            tie_word_embeddings=False,
            num_nextn_predict_layers=0,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
        )


@dataclass(frozen=True)
class LMTrainSpec:
    steps: int = 2000
    batch_size: int = 64
    micro_batch_size: int | None = None  # sequences per forward/backward (None: the whole batch); same step
    seq_len: int = 512
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup: int = 100
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-3  # DeepSeek-V3's gamma for the correction bias
    eval_every: int = 500
    eval_windows: int = 64
    time_limit_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 2 or self.eval_every < 1:
            raise TrainError("steps, batch_size, eval_every must be >= 1 and seq_len >= 2")
        if self.micro_batch_size is not None and not 1 <= self.micro_batch_size <= self.batch_size:
            raise TrainError(
                f"micro_batch_size must be in [1, batch_size {self.batch_size}], got {self.micro_batch_size}"
            )

    def schedule(self) -> Schedule:
        return Schedule(self.lr, self.steps, self.warmup, time_limit_s=self.time_limit_s)


def pick_experts_implementation(model, device: torch.device, log: Logger) -> str:
    """Use transformers' grouped_mm experts when one training step runs with it here, else its
    per-expert loop (both compute the same function)."""
    if device.type != "cuda":
        return str(model.config._experts_implementation)
    probe = torch.randint(0, model.config.vocab_size, (2, 17), device=device)
    for impl in ("grouped_mm", "eager"):
        model.config._experts_implementation = impl
        try:
            with autocast(device):
                loss = lm_loss(model, probe)
            loss.backward()
            model.zero_grad(set_to_none=True)
            log("experts_implementation", impl=impl)
            return impl
        except Exception as exc:  # noqa: BLE001 - any failure means: use the next implementation
            log("experts_implementation_failed", impl=impl, error=repr(exc)[:200])
            model.zero_grad(set_to_none=True)
    raise TrainError("no experts implementation runs on this device")


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:  # batch [B, T+1]
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits  # [B, T, V]
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def accumulate_lm_loss(model, batch: torch.Tensor, micro: int, device: torch.device) -> torch.Tensor:  # batch [B, T+1]
    """lm_loss of the whole batch with its gradients accumulated, ``micro`` sequences per forward and
    backward: the same loss and gradients (up to float summation order), with activation memory for
    ``micro`` sequences instead of all B (about 230 KB per token for the demo target on CPU)."""
    total = torch.zeros((), device=device)
    for i in range(0, len(batch), micro):
        part = batch[i : i + micro]
        with autocast(device):
            loss = lm_loss(model, part) * (len(part) / len(batch))
        loss.backward()
        total += loss.detach()
    return total


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, device: torch.device, batch_size: int = 16) -> float:
    """Mean next-token cross entropy (nats) over ``windows`` [W, T+1]."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        b = windows[i : i + batch_size].to(device)
        with autocast(device):
            loss = lm_loss(model, b)
        n = b[:, 1:].numel()
        total += float(loss) * n
        count += n
    model.train(was_training)
    return total / count


class RouterLoadTracker:
    """Counts how many tokens each routed expert got (forward hooks on the routers) and applies the
    auxiliary-loss-free bias update after each optimizer step."""

    def __init__(self, model, rate: float) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3TopkRouter,
        )

        self.rate = rate
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.loads = {id(r): torch.zeros(r.num_experts, device=r.weight.device) for r in self.routers}
        self.handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def _hook(self, module, inputs, output) -> None:
        topk_indices = output[2]  # [T, K]
        self.loads[id(module)] += torch.bincount(topk_indices.flatten(), minlength=module.num_experts)

    @torch.no_grad()
    def update(self) -> float:
        """Apply the update; return the worst max/mean load ratio over layers (1.0 = perfectly even)."""
        worst = 1.0
        for r in self.routers:
            load = self.loads[id(r)]
            if load.sum() > 0:
                mean = load.mean()
                r.e_score_correction_bias += self.rate * torch.sign(mean - load)
                worst = max(worst, float(load.max() / mean))
            load.zero_()
        return worst

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def train_lm(
    model,
    train_stream,
    valid_stream,
    spec: LMTrainSpec,
    device: torch.device,
    log: Logger,
    load_tracker_rate: float | None = None,
    deadline: float | None = None,
    after_windows: int = 0,
) -> dict:
    """Plain next-token LM training on random windows, early-stopped on the validation stream: the
    weights of the best validation evaluation are restored at the end. Returns the run's summary.

    With ``deadline`` (time.monotonic(); the command's start + its --time-limit-s), the run ends by then
    with its final evaluations: one validation batch is timed first, and the loop's time limit leaves
    room for the final validation pass plus ``after_windows`` windows the caller evaluates afterwards.
    Without it, ``spec.time_limit_s`` bounds the loop alone."""
    model.to(device).train()
    pick_experts_implementation(model, device, log)
    sampler = WindowSampler(train_stream, spec.seq_len, spec.batch_size, spec.seed)
    ev = eval_windows(valid_stream, spec.seq_len, spec.eval_windows)
    opt = make_optimizer(model.parameters(), spec.lr, spec.weight_decay, device)
    time_limit_s = spec.time_limit_s
    if deadline is not None:
        time_limit_s = _loop_time_limit(model, ev, device, deadline, after_windows, log)
    sched = replace(spec.schedule(), time_limit_s=time_limit_s)
    tracker = RouterLoadTracker(model, load_tracker_rate) if load_tracker_rate else None
    progress = Progress("train target", spec.steps, spec.batch_size * spec.seq_len, time_limit_s)
    t0 = time.monotonic()
    step, loss_val, imbalance, step_s = 0, float("nan"), 1.0, 0.0
    history = []
    best = (float("inf"), 0, None)  # (valid loss, step, state on CPU)
    while True:
        # the time a step would end at: a slow step (seconds on CPU) may not start just before the limit
        lr = sched.set_lr(opt, step, time.monotonic() - t0 + (step_s if deadline is not None else 0.0))
        if lr is None:
            break
        t_step = time.monotonic()
        batch = sampler.next().to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = accumulate_lm_loss(model, batch, spec.micro_batch_size or spec.batch_size, device)
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        if tracker is not None:
            imbalance = tracker.update()
        step += 1
        logged = step % 50 == 0 or step == 1
        if logged:
            loss_val = float(loss.detach())
            log(
                "train",
                step=step,
                loss=loss_val,
                lr=lr,
                max_load_ratio=imbalance,
                tok_per_s=round(step * spec.batch_size * spec.seq_len / (time.monotonic() - t0)),
            )
        progress.step(step, loss_val if logged else None)
        if step % spec.eval_every == 0:
            best = _evaluate(model, ev, device, step, history, best, log)
        step_s = time.monotonic() - t_step if step_s == 0.0 else 0.8 * step_s + 0.2 * (time.monotonic() - t_step)
    progress.close()
    if tracker is not None:
        tracker.close()
    if not history or history[-1]["step"] != step:  # the last step's weights were not evaluated yet
        best = _evaluate(model, ev, device, step, history, best, log)
    model.load_state_dict(best[2])
    log("restored_best", step=best[1], valid_loss=best[0])
    return {
        "best_step": best[1],
        "best_valid_loss": best[0],
        "steps_run": step,
        "stopped_by": "steps" if step >= spec.steps else "time_limit",
        "train_seconds": round(time.monotonic() - t0, 1),
        "loop_time_limit_s": None if time_limit_s is None else round(time_limit_s, 1),
        "last_train_loss": loss_val,
        "valid_windows": int(len(ev)),
        "valid_history": history,
        "final_max_load_ratio": imbalance,
    }


def _loop_time_limit(model, windows, device, deadline: float, after_windows: int, log: Logger) -> float:
    """Seconds the training loop may run so that the final validation pass over ``windows`` and
    ``after_windows`` more windows still end by ``deadline`` (timed on one evaluation batch, plus 20%)."""
    n = min(len(windows), 16)
    t = time.monotonic()
    heldout_loss(model, windows[:n], device)
    per_window = (time.monotonic() - t) / n
    reserve = 1.2 * per_window * (len(windows) + after_windows) + 1.0  # + 1 s to save the checkpoint
    remaining = deadline - time.monotonic()
    log("time_budget", seconds_left=round(remaining, 1), final_eval_reserve_s=round(reserve, 1))
    if remaining <= reserve:
        raise TrainError(
            f"--time-limit-s leaves no time to train: {max(remaining, 0):.0f} s are left after loading, "
            f"and the final evaluations need about {reserve:.0f} s"
        )
    return remaining - reserve


def _evaluate(model, windows, device, step, history, best, log):
    loss = heldout_loss(model, windows, device)
    history.append({"step": step, "valid_loss": loss})
    log("eval", step=step, valid_loss=loss)
    if loss < best[0]:
        best = (loss, step, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
    return best


def save_bf16_pretrained(model, out_dir: Path, keep_fp32: tuple[str, ...] = ("e_score_correction_bias",)) -> None:
    """save_pretrained in bfloat16 (safetensors), leaving buffers named in ``keep_fp32`` in float32."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to("cpu")
    saved = {n: b.detach().clone() for n, b in model.named_buffers() if n.split(".")[-1] in keep_fp32}
    model.to(torch.bfloat16)
    for name, value in saved.items():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        setattr(module, name.rsplit(".", 1)[1], value.float())
    model.save_pretrained(out_dir, safe_serialization=True)


def copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    tokenizer_dir = Path(tokenizer_dir)
    src_dir = tokenizer_dir if tokenizer_dir.is_dir() else tokenizer_dir.parent
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src_dir / name).is_file():
            shutil.copyfile(src_dir / name, out_dir / name)


def checkpoint_summary(out_dir: Path) -> dict:
    return {"bytes": folder_size_bytes(out_dir), "mib": round(folder_size_bytes(out_dir) / 2**20, 2)}
