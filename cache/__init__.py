"""kvroute.cache."""
