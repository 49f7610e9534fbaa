"""Passages, their vectors and indexes, and the retriever that joins them."""
