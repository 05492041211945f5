"""kvroute.router.policies."""
