"""Pipeline schedules: per-device op orders and the simulator that prices an iteration.

Entry points: ``simulate_iteration`` / ``simulate_pipeline`` (simulator), ``orders_for`` (orders),
``simulate_shared`` (shared_host: replicas whose devices share one host's compute). Pure: numpy only.
"""
