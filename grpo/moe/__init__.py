"""Mixture-of-Experts policies: which experts each token went to, recorded and replayed (routing.py)."""
