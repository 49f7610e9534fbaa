"""Serving a bundle over HTTP: dynamic batching (`batching`), counters (`metrics`), deadlines on
slow clients (`connections`), the API's contract and request checks (`api`), what the routes
share (`state`), and the routes with their page (`app`)."""
