"""Node-local sidecar agent: hook server, GPU sampler, pid watch, uplink."""
