"""What goes into an audit: the terms a module hands over (``terms``), the partitions of its trained
positions (``partition``), and multi-turn trajectories tokenised turn by turn (``trajectories``).

The public names are exported from :mod:`lens_callbacks.credit`.
"""
