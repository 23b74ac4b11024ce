"""Tests of cache_manager/."""
