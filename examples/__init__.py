"""Example implementations to put on trial with the kit (README, "The kit in ten lines")."""
