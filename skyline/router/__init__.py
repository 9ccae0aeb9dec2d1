"""A fleet behind one endpoint: `skyline router` routes OpenAI requests over replicas (each a
`skyline serve`), by where their prompts are cached and how loaded each replica is."""
