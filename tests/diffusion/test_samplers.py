"""The one sampler loop: Euler steps, the timestep check, classifier-free guidance."""
import pytest
import torch

from megaslide.diffusion.flow import interpolate
from megaslide.diffusion.samplers import check_timesteps, euler_integrate, euler_sample


def test_euler_recovers_data_under_the_exact_velocity():
    """On a straight rectified-flow path the true velocity noise - x0 is constant: any schedule ends at x0."""
    x0, noise = torch.randn(2, 3, 4, 4, 4), torch.randn(2, 3, 4, 4, 4)
    seen = []

    def velocity(x, t):
        seen.append(t)
        torch.testing.assert_close(x, interpolate(x0, noise, torch.full((2,), t)))  # on the path at every step
        return noise - x0

    out = euler_integrate(velocity, noise, (1.0, 0.75, 0.5, 0.25))
    assert seen == [1.0, 0.75, 0.5, 0.25]
    torch.testing.assert_close(out, x0)


def test_euler_step_sizes_follow_the_schedule():
    """dx/dt = 1: each step moves x by t_next - t, the last one to t = 0, so x ends at x(1) - 1."""
    out = euler_integrate(lambda x, t: torch.ones_like(x), torch.zeros(1), (1.0, 0.6, 0.1))
    torch.testing.assert_close(out, torch.tensor([-1.0]))
    out = euler_integrate(lambda x, t: x, torch.ones(1), (1.0, 0.5))   # dx/dt = x: two steps of (1 - 0.5)
    torch.testing.assert_close(out, torch.tensor([0.25]))


@pytest.mark.parametrize("bad", [(), (0.5, 0.75), (1.0, 1.0), (1.5, 0.5), (1.0, 0.0)])
def test_timesteps_must_descend_inside_zero_one(bad):
    with pytest.raises(ValueError, match="strictly descending"):
        check_timesteps(bad)


class Linear:
    """A 'model' whose velocity is x scaled by the caption value; records the batch it saw."""

    def __init__(self):
        self.batches = []

    def __call__(self, x, t, context):
        self.batches.append(x.shape[0])
        return x * context.view(-1, *([1] * (x.dim() - 1)))


def test_guidance_mixes_conditional_and_unconditional_in_one_batch():
    x = torch.ones(1, 1, 1, 1, 1)
    cond, null = torch.tensor([2.0]), torch.tensor([1.0])
    model = Linear()
    out = euler_sample(model, x, cond, null, cfg_scale=3.0, timesteps=[1.0])
    assert model.batches == [2]
    torch.testing.assert_close(out, x * (1 - (1 + 3.0 * (2 - 1))))   # v = v_u + 3 (v_c - v_u) = 4 x
    model = Linear()
    euler_sample(model, x, cond, null, cfg_scale=1.0, steps=3)
    assert model.batches == [1, 1, 1]
    with pytest.raises(ValueError, match="strictly descending"):
        euler_sample(model, x, cond, timesteps=[0.5, 0.9])
