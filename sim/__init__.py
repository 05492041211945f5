"""kvroute.sim."""
