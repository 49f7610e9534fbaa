"""Serving a bundle over HTTP: dynamic batching (`batching`), counters (`metrics`) and the JSON
API with its page (`app`)."""
