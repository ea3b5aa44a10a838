"""grpo: a readable GRPO loop with swappable rollout backends and parallel strategies."""

__version__ = "0.1.0"
