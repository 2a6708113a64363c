"""Plug-ins of one's own, written as a user would against verst's contracts: a rollout strategy
(rollout_strategy.py), a reward shaping (reward_shaping.py), a group filter (group_filter.py),
data sources (data_source.py) and an engine backend (engine_backend.py),
each named by its ``module:function`` in a JobSpec (the engine backend in VERST_ENGINE_BACKEND)."""
