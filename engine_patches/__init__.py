"""kvroute.engine_patches."""
