"""Launching jobs: smddp-launch, smddp-daemon and the smddp command; builds on daemon and client."""
