"""Baselines: dense 3D-DiT and Swin-DiT. Importing this package registers `swin`."""
from baselines import swin_attention  # noqa: F401  (registers 'swin')
from baselines.presets import dense_dit, swin_dit  # noqa: F401
