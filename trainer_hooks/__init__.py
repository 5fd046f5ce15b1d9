"""The two calls a training loop adds, and the runtime they reshape."""
