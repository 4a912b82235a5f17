"""Benchmarks, apart from the serving code: ``meridian bench <target>`` runs one; each
compares against a baseline measured in the same run and prints one JSON object."""
