"""The generation bridge: update payloads, the JAX engine as an HTTP server, the fleet client."""
