"""Plug-ins of one's own, written as a user would against verst's contracts: a rollout strategy
(rollout_strategy.py), a reward shaping (reward_shaping.py) and data sources (data_source.py),
each named in a JobSpec by its ``module:function``."""
