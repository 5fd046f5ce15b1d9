"""Put on a torchrun-style rank's PYTHONPATH by launch/rank_env.py; see env_rendezvous.py."""
