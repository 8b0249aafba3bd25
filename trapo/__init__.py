"""TraPO: Trajectory-based Policy Optimization for semi-supervised RLVR."""

__version__ = "0.1.0"
