"""kvroute.bench."""
