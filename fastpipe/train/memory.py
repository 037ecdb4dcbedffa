"""`fastpipe memory`: who eats the GPU memory, predicted before the OOM.

Static parts come from the model (numel x element size): parameters, gradients, optimizer state (SGD momentum:
one copy of the parameters, Adam/AdamW: two). Activations are measured, not guessed: a real training step at
two batch sizes, and a straight line through them gives bytes per image, so the prediction holds for any batch.
On CUDA the two points are peaks of `max_memory_allocated` over a whole step (everything included: workspace,
allocator rounding); on a CPU they are the bytes of the tensors autograd saves for backward (saved-tensor hooks),
labelled as such: a lower bound of what a GPU would hold.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from fastpipe.errors import ConfigError
from fastpipe.train.config import MemoryConfig

MB = 2**20
SAFETY = 0.92  # share of the device memory to plan for: the caching allocator fragments and CUDA needs some


@dataclass
class MemoryReport:
    config: dict
    measured_on: str  # "cuda: <name>" or "cpu: saved tensors"
    params_mb: float
    grads_mb: float
    optimizer_mb: float
    buffers_mb: float
    activations_mb_per_image: float
    fixed_mb: float  # everything not proportional to the batch (static + workspace, as measured)
    budget_mb: float | None  # the memory planned for
    techniques: list[dict]

    def total_mb(self, batch: int) -> float:
        return self.fixed_mb + batch * self.activations_mb_per_image

    @property
    def other_fixed_mb(self) -> float:
        """What the fixed part holds beyond parameters, gradients, optimizer state and buffers."""
        return self.fixed_mb - (self.params_mb + self.grads_mb + self.optimizer_mb + self.buffers_mb)

    @property
    def lower_bound(self) -> bool:
        """Measured on a CPU: the batch-dependent figures are at least what a GPU holds, never more."""
        return self.measured_on.startswith("cpu")

    def max_batch(self, budget_mb: float | None = None) -> int | None:
        budget = budget_mb or self.budget_mb
        if not budget or self.activations_mb_per_image <= 0:
            return None
        return max(0, math.floor((budget * SAFETY - self.fixed_mb) / self.activations_mb_per_image))

    def as_dict(self) -> dict:
        b = self.config["batch_size"]
        return {**asdict(self), "total_mb": self.total_mb(b), "activations_mb": b * self.activations_mb_per_image,
                "max_batch": self.max_batch(), "lower_bound": self.lower_bound}


def optimizer_state_factor(optimizer: str, momentum: bool = True) -> int:
    """Optimizer state per parameter, in parameter copies."""
    if optimizer in ("adam", "adamw"):
        return 2  # exp_avg and exp_avg_sq
    return 1 if momentum else 0  # SGD's momentum buffer


def static_bytes(model: nn.Module, optimizer: str) -> dict[str, int]:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return {"params": params, "grads": trainable, "optimizer": trainable * optimizer_state_factor(optimizer),
            "buffers": buffers}


def _model(cfg: MemoryConfig, device: torch.device) -> nn.Module:
    from fastpipe.train.models import build_model

    model = build_model(cfg.model, cfg.num_classes, cfg.image_size,
                        checkpoint_activations=cfg.checkpoint_activations).to(device)
    return model.to(memory_format=torch.channels_last) if cfg.channels_last else model


def _step(model, opt, batch: int, cfg: MemoryConfig, device: torch.device) -> None:
    x = torch.randn(batch, 3, cfg.image_size, cfg.image_size, device=device)
    if cfg.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, cfg.num_classes, (batch,), device=device)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.amp)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _make_opt(model, cfg: MemoryConfig):
    if cfg.optimizer in ("adam", "adamw"):
        return torch.optim.AdamW(model.parameters(), lr=1e-6)
    return torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)


def cuda_peak(cfg: MemoryConfig, batch: int, device: torch.device) -> int:
    """Peak bytes allocated during one full training step (after a warm-up step that creates the gradients,
    the optimizer state and cuDNN's choices)."""
    model = _model(cfg, device)
    opt = _make_opt(model, cfg)
    try:
        _step(model, opt, batch, cfg, device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        _step(model, opt, batch, cfg, device)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    finally:
        del model, opt
        torch.cuda.empty_cache()


def saved_tensor_bytes(cfg: MemoryConfig, batch: int) -> int:
    """Bytes autograd keeps for backward in one forward pass on the CPU (each storage counted once, the
    parameters left out: they are static memory)."""
    device = torch.device("cpu")
    model = _model(cfg, device).train()
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs:
            seen[s.data_ptr()] = s.nbytes()
        return t

    x = torch.randn(batch, 3, cfg.image_size, cfg.image_size)
    if cfg.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    # A CPU has no fp16 autocast worth measuring: bf16 keeps the same 2-byte activations fp16 would on a GPU.
    dtype = torch.bfloat16 if cfg.amp in ("bf16", "fp16") else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        model(x).sum().backward()
    return sum(seen.values())


def _points(cfg: MemoryConfig, device: torch.device) -> tuple[float, float]:
    """(bytes per image, fixed bytes) from two measured batch sizes."""
    if device.type == "cuda":
        b1, b2 = 4, 12
        p1, p2 = cuda_peak(cfg, b1, device), cuda_peak(cfg, b2, device)
    else:
        b1, b2 = 2, 4
        p1, p2 = saved_tensor_bytes(cfg, b1), saved_tensor_bytes(cfg, b2)
    slope = max((p2 - p1) / (b2 - b1), 0.0)
    return slope, p1 - slope * b1


def analyse(cfg: MemoryConfig, techniques: bool = True, log=None) -> MemoryReport:
    """The memory of one training step of cfg's model, and (`techniques`) what each saving technique changes.
    `log(line)` says what is being measured as it goes: each variant takes seconds to a minute on a CPU."""
    cfg = cfg.resolved()
    device = torch.device(cfg.device)
    model = _model(cfg, torch.device("cpu"))  # static sizes do not depend on the device
    static = static_bytes(model, cfg.optimizer)
    if log:
        log(f"measuring {cfg.model} at {cfg.image_size}px, amp {cfg.amp}, two small batches on {cfg.device} ...")
    slope, intercept = _points(cfg, device)
    static_total = sum(static.values())
    if device.type == "cuda":
        fixed = intercept  # measured: static + workspace + allocator rounding
        budget = (cfg.gpu_memory or torch.cuda.get_device_properties(device).total_memory) / MB
        where = f"cuda: {torch.cuda.get_device_name(device)}"
    else:
        fixed = static_total + max(intercept, 0)  # saved-tensor bytes that do not grow with the batch
        budget = cfg.gpu_memory / MB if cfg.gpu_memory else None
        where = "cpu: saved tensors (a lower bound of the GPU figure)"
    report = MemoryReport(asdict(cfg), where, static["params"] / MB, static["grads"] / MB, static["optimizer"] / MB,
                          static["buffers"] / MB, slope / MB, fixed / MB, budget, [])
    if techniques:
        report.techniques = _techniques(cfg, report, log)
    return report


def _techniques(cfg: MemoryConfig, base: MemoryReport, log=None) -> list[dict]:
    """What each memory-saving technique changes, each measured the same way."""
    options = []
    if cfg.amp == "off":
        options.append(("--amp bf16" if not torch.cuda.is_available() else "--amp fp16",
                        replace(cfg, amp="bf16" if not torch.cuda.is_available() else "fp16")))
    if not cfg.checkpoint_activations:
        options.append(("--checkpoint-activations", replace(cfg, checkpoint_activations=True)))
    small = max(32, int(cfg.image_size * 0.75) // 32 * 32)
    if small < cfg.image_size:
        options.append((f"--image-size {small}", replace(cfg, image_size=small)))
    if cfg.optimizer in ("adam", "adamw"):
        options.append(("--optimizer sgd", replace(cfg, optimizer="sgd")))
    rows = []
    for n, (label, variant) in enumerate(options, 1):
        if log:
            log(f"what-if {n}/{len(options)}: {label} ...")
        r = analyse(variant, techniques=False)
        rows.append({"technique": label, "total_mb": r.total_mb(cfg.batch_size),
                     "saves_mb": base.total_mb(cfg.batch_size) - r.total_mb(cfg.batch_size),
                     "activations_mb_per_image": r.activations_mb_per_image, "max_batch": r.max_batch(base.budget_mb)})
    return rows


def format_report(r: MemoryReport) -> str:
    """The breakdown. Measured on a CPU, every figure that depends on the activations says which way it errs, where
    it stands: the GPU needs at least that much, so its largest batch is at most the one given."""
    b, low = r.config["batch_size"], r.lower_bound
    least = "at least " if low else ""
    lines = [f"{r.config['model']} at {r.config['image_size']}px, batch {b}, {r.config['optimizer']}, "
             f"amp {r.config['amp']} — measured on {r.measured_on}",
             f"  parameters         {r.params_mb:10.1f} MB",
             f"  gradients          {r.grads_mb:10.1f} MB",
             f"  optimizer state    {r.optimizer_mb:10.1f} MB   ({r.config['optimizer']})",
             f"  buffers            {r.buffers_mb:10.1f} MB",
             f"  activations        {b * r.activations_mb_per_image:10.1f} MB   "
             f"({least}{r.activations_mb_per_image:.2f} MB per image{'; a GPU holds more' if low else ''})",
             f"  other fixed        {r.other_fixed_mb:10.1f} MB   "
             + ("(saved tensors only: a GPU adds workspace and allocator rounding)" if low
                else "(workspace, allocator; measured)"),
             f"  total              {r.total_mb(b):10.1f} MB   "
             + ("(the lines above, added: a GPU needs at least this)" if low else "(the lines above, added)")]
    if r.budget_mb:
        lines.append(_fit_line(r, b))
    if r.techniques:
        lines.append("  what each technique would change (same batch" + ("; lower bounds, as above):" if low else "):"))
        for t in r.techniques:
            mb = f", largest batch {'at most ' if low else ''}{t['max_batch']}" if t["max_batch"] is not None else ""
            change = f"saves {'about ' if low else ''}{t['saves_mb']:.1f} MB" if t["saves_mb"] >= 0 else \
                f"costs {'about ' if low else ''}{-t['saves_mb']:.1f} MB more"
            lines.append(f"    {t['technique']:28s} total {least}{t['total_mb']:9.1f} MB ({change}{mb})")
    return "\n".join(lines)


def _fit_line(r: MemoryReport, b: int) -> str:
    """Whether batch b fits the budget, and the largest batch that does; from a lower bound, what can be said."""
    over = r.total_mb(b) > r.budget_mb * SAFETY
    against = f"  against {r.budget_mb / 1024:.1f} GB (planning for {SAFETY:.0%} of it): "
    if not r.lower_bound:
        return against + f"{'DOES NOT FIT' if over else 'fits'}; largest batch that fits: {r.max_batch()}"
    return against + (f"{'DOES NOT FIT, even at this lower bound' if over else 'may fit (needs at least the total)'}"
                      f"; largest batch at most {r.max_batch()}; measure on the GPU (`fastpipe memory` there, or "
                      f"`fastpipe train --auto-batch`)")


def find_max_batch(cfg: MemoryConfig, limit: int = 4096) -> int:
    """The largest batch that trains on this GPU: the prediction, confirmed by a real step (stepping down by
    10 % on OOM)."""
    device = torch.device(cfg.device or "cuda")
    free, _total = torch.cuda.mem_get_info(device)
    report = analyse(replace(cfg, gpu_memory=free), techniques=False)
    batch = min(limit, max(1, report.max_batch() or 1))
    while batch >= 1:
        try:
            cuda_peak(cfg, batch, device)
            return batch
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            batch = int(batch * 0.9) if batch > 10 else batch - 1
    raise ConfigError(f"{cfg.model} at {cfg.image_size}px does not train even with batch 1 on {device}: use a "
                      f"smaller --image-size, --checkpoint-activations, --amp fp16, or a smaller model")
