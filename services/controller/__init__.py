"""The job controller: the RL loop of every job, from its first checkpoint to its outcome.

``driver.py`` is the loop of one job, read top-down; ``controller.py`` keeps one driver per
unfinished job. The controller runs inside the api's process by default, or as its own process
(``python -m services.controller``, with ``VERST_API_CONTROLLER=false`` on the api).
"""
