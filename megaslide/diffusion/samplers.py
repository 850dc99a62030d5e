"""Samplers for the rectified-flow DiT: Euler with classifier-free guidance."""
from __future__ import annotations

import torch

from megaslide.diffusion.flow import TIME_SCALE


def guided_velocity(model, x, t, context, null_context, cfg_scale: float, **kw) -> torch.Tensor:
    """v_uncond + s * (v_cond - v_uncond), both halves in one batch; s = 1 skips the unconditional pass."""
    tt = torch.full((x.shape[0],), float(t) * TIME_SCALE, device=x.device)
    if cfg_scale == 1.0 or null_context is None:
        return model(x, tt, context, **kw)
    v = model(torch.cat([x, x]), torch.cat([tt, tt]), torch.cat([context, null_context]), **kw)
    v_cond, v_uncond = v.chunk(2)
    return v_uncond + cfg_scale * (v_cond - v_uncond)


@torch.no_grad()
def euler_sample(model, noise: torch.Tensor, context, null_context=None, *, steps: int = 20,
                 cfg_scale: float = 1.0, timesteps: list[float] | None = None, **kw) -> torch.Tensor:
    """Integrate dx/dt = v from t = 1 (noise) to t = 0 (data).

    `timesteps` (descending, in (0, 1]) overrides the uniform grid, e.g. the few-step
    schedule [1.0, 0.75, 0.5, 0.25] of causal generation."""
    ts = timesteps if timesteps is not None else torch.linspace(1.0, 0.0, steps + 1)[:-1].tolist()
    ts = list(ts) + [0.0]
    x = noise
    for t, t_next in zip(ts[:-1], ts[1:]):
        v = guided_velocity(model, x, t, context, null_context, cfg_scale, **kw)
        x = x + (t_next - t) * v
    return x
