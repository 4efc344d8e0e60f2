"""Liger-Kernel's RMSNorm, SwiGLU and RoPE swapped into a Llama, in plain torch: what FoRA's code meets when a user
turns Liger on (liger-kernel needs Triton and a CUDA GPU, so it cannot run here).

The swap is Liger's own (``apply_liger_kernel_to_llama(model=...)``, liger_kernel/transformers/monkey_patch.py,
read at linkedin/Liger-Kernel ead96b6): ``forward`` and ``_get_name`` bound on each RMSNorm and MLP instance,
``modeling_llama.apply_rotary_pos_emb`` replaced. Each kernel is an autograd Function, as Liger's are, and does to
its tensors what Liger's Triton kernels do to theirs: RMSNorm's backward writes the input gradient into the output
gradient (``in_place=True``, Liger's default for Llama), SiLU-mul's backward writes its two input gradients into the
saved gate and up outputs. The maths is transformers' own, so a swapped model computes what the original does.
"""

from __future__ import annotations

import contextlib
from types import MethodType

import torch
import torch.nn.functional as F
from transformers.models.llama import modeling_llama


_HF_ROPE = modeling_llama.apply_rotary_pos_emb


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xd, wd = x.detach().requires_grad_(), weight.detach().requires_grad_()
            dx, dw = torch.autograd.grad(_rms_norm(xd, wd, ctx.eps), (xd, wd), dy)
        dy.copy_(dx)  # Liger's in_place: dX is written into dY's memory
        return dy, dw, None


class SiLUMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        with torch.enable_grad():
            ad, bd = a.detach().requires_grad_(), b.detach().requires_grad_()
            da, db = torch.autograd.grad(F.silu(ad) * bd, (ad, bd), dc)
        a.copy_(da)  # Liger's kernel writes da and db over the saved gate and up outputs
        b.copy_(db)
        return a, b


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim):
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim = unsqueeze_dim
        return _HF_ROPE(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        # The rotation is orthogonal: its gradient is the inverse rotation, the same rotation with -sin.
        gq, gk = _HF_ROPE(dq, dk, cos, -sin, unsqueeze_dim=ctx.unsqueeze_dim)
        return gq, gk, None, None, None


def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    return RopeFunction.apply(q, k, cos, sin, unsqueeze_dim)


def _rms_norm_forward(self, hidden_states):
    return RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)


def _swiglu_forward(self, x):
    return self.down_proj(SiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))


def _bind(module: torch.nn.Module, name: str, function) -> None:
    module.__dict__[name] = MethodType(function, module)


@contextlib.contextmanager
def liger_standins(model: torch.nn.Module):
    """Liger's Llama swaps on ``model`` (a LlamaForCausalLM, or a PeftModel of one) while the context is open."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    llama = base.model
    norms = [llama.norm]
    norms += [norm for layer in llama.layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
    mlps = [layer.mlp for layer in llama.layers]
    for norm in norms:
        _bind(norm, "forward", _rms_norm_forward)
        _bind(norm, "_get_name", lambda self: "LigerRMSNorm")
    for mlp in mlps:
        _bind(mlp, "forward", _swiglu_forward)
        _bind(mlp, "_get_name", lambda self: "LigerSwiGLUMLP")
    modeling_llama.apply_rotary_pos_emb = liger_rotary_pos_emb
    try:
        yield
    finally:
        modeling_llama.apply_rotary_pos_emb = _HF_ROPE
        for module in norms + mlps:
            for name in ("forward", "_get_name"):
                module.__dict__.pop(name, None)
