"""Code that runs inside each Ray Train worker. Never imports driver modules."""
