"""kvroute.router."""
