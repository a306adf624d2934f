"""Platform checks (doctor) and the base image command."""
