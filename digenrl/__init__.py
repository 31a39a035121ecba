"""DigenRL: disaggregated Flow-GRPO / DanceGRPO for diffusion and flow-matching generators."""

__version__ = "0.1.0"
