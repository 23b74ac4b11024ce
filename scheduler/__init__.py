"""kvserve package."""
