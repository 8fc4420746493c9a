"""Fewer Gaussians for the same picture: the prune stage's phased pruning with recovery (``prune``) and
the scores that rank Gaussians for it and for pruning during training (``scoring``).
"""
