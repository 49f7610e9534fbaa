"""Serving a bundle over HTTP: dynamic batching (`batching`), counters (`metrics`), deadlines on
slow clients (`connections`) and the JSON API with its page (`app`)."""
