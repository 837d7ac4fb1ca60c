"""Revisions of a model: the ones this server keeps and serves, the ones trainers publish, and what changed
between two of them (store, published, changes)."""
