"""The OpenAI-compatible HTTP gateway (``weir gateway``) and its router across engine replicas."""
