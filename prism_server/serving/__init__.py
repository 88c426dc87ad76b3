"""The event-loop side: the HTTP app, the OpenAI protocol, the frontend, metrics, the dashboard."""
