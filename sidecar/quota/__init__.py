"""Quota mode (Envoy's Rate Limit Quota Service): reserved for the RLQS service."""
