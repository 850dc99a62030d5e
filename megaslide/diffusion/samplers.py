"""The one sampler loop of the rectified-flow DiT: Euler steps, optionally with classifier-free guidance.

Convention (as in `flow.py`): x_t = (1 - t) x0 + t noise, the model predicts v = noise - x0 at
model timestep TIME_SCALE * t, and sampling integrates dx/dt = v from t = 1 down to t = 0.
`euler_integrate` is the loop; `euler_sample` runs it on a whole model (with CFG), and the
sequence-parallel samplers of `megaslide.inference` run it on their token shards.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megaslide.diffusion.flow import TIME_SCALE

FEW_STEP_TIMESTEPS = (1.0, 0.75, 0.5, 0.25)
"""The few-step schedule of causal (Self-Forcing style) generation; the last step goes to 0."""


def check_timesteps(timesteps: Sequence[float]) -> tuple[float, ...]:
    """`timesteps` as floats, or ValueError unless they are strictly descending values in (0, 1]."""
    ts = tuple(float(t) for t in timesteps)
    if not ts or any(not 0 < t <= 1 for t in ts) or any(a <= b for a, b in zip(ts, ts[1:])):
        raise ValueError(f"timesteps={ts} must be strictly descending values in (0, 1], e.g. {FEW_STEP_TIMESTEPS}")
    return ts


def euler_integrate(velocity: Callable[[torch.Tensor, float], torch.Tensor], x: torch.Tensor,
                    timesteps: Sequence[float]) -> torch.Tensor:
    """x <- x + (t_next - t) * velocity(x, t) for each t of `timesteps` (descending), the last step to t = 0.

    `velocity(x, t)` takes the state and a time t in [0, 1] and returns dx/dt in the shape of x."""
    ts = list(timesteps) + [0.0]
    for t, t_next in zip(ts[:-1], ts[1:]):
        x = x + (t_next - t) * velocity(x, t)
    return x


def model_timesteps(t: float, batch: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The model's timestep input (batch,) for a time t in [0, 1]: TIME_SCALE * t."""
    return torch.full((batch,), float(t) * TIME_SCALE, device=device)


def guided_velocity(model, x, t, context, null_context, cfg_scale: float, context_mask=None, null_mask=None,
                    **kw) -> torch.Tensor:
    """v_uncond + s * (v_cond - v_uncond), both halves in one batch; s = 1 skips the unconditional pass.
    `context_mask` / `null_mask` (B, L): which caption embeddings are real tokens (None: all); the model gets
    them as its `context_mask` keyword, and only when one is given."""
    tt = model_timesteps(t, x.shape[0], x.device)
    if cfg_scale == 1.0 or null_context is None:
        return model(x, tt, context, **kw, **({} if context_mask is None else {"context_mask": context_mask}))
    if context_mask is not None or null_mask is not None:
        ones = torch.ones(context.shape[:2], dtype=torch.bool, device=context.device)   # (B, L)
        kw["context_mask"] = torch.cat([ones if context_mask is None else context_mask,
                                        ones if null_mask is None else null_mask])     # (2B, L)
    v = model(torch.cat([x, x]), torch.cat([tt, tt]), torch.cat([context, null_context]), **kw)
    v_cond, v_uncond = v.chunk(2)
    return v_uncond + cfg_scale * (v_cond - v_uncond)


@torch.no_grad()
def euler_sample(model, noise: torch.Tensor, context, null_context=None, *, steps: int = 20,
                 cfg_scale: float = 1.0, timesteps: Sequence[float] | None = None, **kw) -> torch.Tensor:
    """Integrate dx/dt = model(x, 1000 t, context) from t = 1 (noise (B, C, T, H, W)) to t = 0 (data).

    `timesteps` (strictly descending, in (0, 1]) overrides the uniform grid of `steps` steps,
    e.g. FEW_STEP_TIMESTEPS; `kw` go to `guided_velocity` (caption masks) and on to the model."""
    ts = check_timesteps(timesteps) if timesteps is not None else torch.linspace(1.0, 0.0, steps + 1)[:-1].tolist()
    return euler_integrate(lambda x, t: guided_velocity(model, x, t, context, null_context, cfg_scale, **kw),
                           noise, ts)
