"""Deployments of skyline above one host: Ray Serve (ray.py)."""
