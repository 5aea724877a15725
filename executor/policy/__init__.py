"""Who may do what and when a person must decide: authorization, approval rules, per-tool limits."""
