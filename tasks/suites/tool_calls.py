"""Structured tool calls: turn a request into one call of the right tool.

The model sees the tools of ``tasks/function_tools.py`` (name, description, JSON
Schema of the arguments) in the system message and a user request, and
answers with ``{"name": ..., "arguments": {...}}`` in a ```json block. The
``tool_call`` verifier validates the arguments against the tool's schema and
compares them with ``expected`` (numbers within a tolerance, strings
ignoring case, lists in any order): reward 1 or 0.

``reference`` is the expected call; ``wrong`` is a schema-valid call that
gets one thing wrong (``wrong_args`` replaces arguments; ``wrong_name``
calls another tool). The split is fixed by a hash of the id (about 20 %
held out).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from conveyor.contracts import ChatMessage, Task, VerifierSpec
from tasks.function_tools import TOOLS
from tasks.suites import split_of, suite_task

SUITE = "tool_calls"

SYSTEM = (
    "You can call these tools (JSON Schema of each tool's arguments):\n\n"
    + json.dumps([t.spec() for t in TOOLS.values()], indent=1)
    + '\n\nAnswer with exactly one tool call, a JSON object {"name": <tool name>, "arguments": {...}}, '
    "in a ```json code block. The arguments must follow the tool's schema."
)


@dataclass(frozen=True)
class Problem:
    id: str
    difficulty: int  # 1 (easy) .. 3 (hard)
    request: str
    name: str
    arguments: dict[str, Any]  # the expected call's arguments; all of them must match
    wrong_args: dict[str, Any] = field(default_factory=dict)
    wrong_name: str | None = None

    @property
    def split(self) -> str:
        return split_of(SUITE, self.id)

    @property
    def expected(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}

    @property
    def reference(self) -> str:
        return f"```json\n{json.dumps(self.expected)}\n```\n"

    @property
    def wrong(self) -> str:
        args = self.wrong_args if self.wrong_name else {**self.arguments, **self.wrong_args}
        return f"```json\n{json.dumps({'name': self.wrong_name or self.name, 'arguments': args})}\n```\n"


_PROBLEMS = [
    # get_weather
    Problem("weather_paris", 1, "What's the weather like in Paris right now? Use Celsius.",
            "get_weather", {"city": "Paris", "unit": "celsius"}, {"city": "London"}),
    Problem("weather_new_york_f", 1, "Is it cold in New York today? Give me the temperature in Fahrenheit.",
            "get_weather", {"city": "New York", "unit": "fahrenheit"}, {"unit": "celsius"}),
    Problem("weather_tokyo", 1, "Check the weather in Tokyo for me.",
            "get_weather", {"city": "Tokyo"}, {"city": "Kyoto"}),
    Problem("weather_reykjavik", 1, "How warm is it in Reykjavik, in degrees Celsius?",
            "get_weather", {"city": "Reykjavik", "unit": "celsius"}, {"unit": "fahrenheit"}),
    Problem("weather_san_francisco", 1, "What's the weather in San Francisco, in Fahrenheit?",
            "get_weather", {"city": "San Francisco", "unit": "fahrenheit"}, {"city": "Los Angeles"}),
    # search_flights
    Problem("flights_lhr_jfk", 2, "Find flights from London Heathrow (LHR) to New York JFK on 2025-03-14.",
            "search_flights", {"origin": "LHR", "destination": "JFK", "date": "2025-03-14"},
            {"origin": "JFK", "destination": "LHR"}),
    Problem("flights_budget", 2, "I need a flight from SFO to Seattle (SEA) on June 2, 2025, for less than $150.",
            "search_flights", {"origin": "SFO", "destination": "SEA", "date": "2025-06-02", "max_price": 150},
            {"max_price": 1500}),
    Problem("flights_group", 2, "Search flights for 3 people from Paris CDG to Rome FCO on 2025-07-19.",
            "search_flights", {"origin": "CDG", "destination": "FCO", "date": "2025-07-19", "passengers": 3},
            {"passengers": 1}),
    Problem("flights_spelled_date", 3, "Look for flights from Berlin (BER) to Madrid (MAD) on the 5th of December 2025, "
            "at most 200 per ticket.",
            "search_flights", {"origin": "BER", "destination": "MAD", "date": "2025-12-05", "max_price": 200},
            {"date": "2025-05-12"}),
    Problem("flights_home", 2, "I'm in Boston (BOS) and want to fly home to Denver (DEN) on 2025-01-30.",
            "search_flights", {"origin": "BOS", "destination": "DEN", "date": "2025-01-30"},
            {"origin": "DEN", "destination": "BOS"}),
    # convert_currency
    Problem("convert_usd_eur", 1, "How much is 250 US dollars in euros?",
            "convert_currency", {"amount": 250, "from": "USD", "to": "EUR"}, {"to": "GBP"}),
    Problem("convert_jpy_usd", 1, "Convert 10,000 Japanese yen to US dollars.",
            "convert_currency", {"amount": 10000, "from": "JPY", "to": "USD"}, {"amount": 1000}),
    Problem("convert_gbp_chf", 2, "I have 19.99 pounds sterling; what is that in Swiss francs?",
            "convert_currency", {"amount": 19.99, "from": "GBP", "to": "CHF"}, {"from": "EUR"}),
    Problem("convert_million_rupees", 2, "What are 1.5 million Indian rupees in euros?",
            "convert_currency", {"amount": 1500000, "from": "INR", "to": "EUR"}, {"amount": 1.5}),
    Problem("convert_eur_cad", 1, "Convert 75 euros to Canadian dollars.",
            "convert_currency", {"amount": 75, "from": "EUR", "to": "CAD"}, {"from": "CAD", "to": "EUR"}),
    Problem("convert_pesos", 3, "Before my trip: how many Mexican pesos would I get for 300 dollars (USD)?",
            "convert_currency", {"amount": 300, "from": "USD", "to": "MXN"},
            {"city": "Mexico City"}, wrong_name="get_weather"),
    # create_event
    Problem("event_standup", 2, "Schedule a 15-minute 'Daily standup' on 2025-04-07 at 09:30 with ana@example.com "
            "and ben@example.com.",
            "create_event", {"title": "Daily standup", "start": "2025-04-07T09:30", "duration_minutes": 15,
                             "attendees": ["ana@example.com", "ben@example.com"]}, {"duration_minutes": 30}),
    Problem("event_design_review", 2, "Create an event called 'Design review' starting March 3, 2025 at 2 pm, "
            "lasting an hour and a half.",
            "create_event", {"title": "Design review", "start": "2025-03-03T14:00", "duration_minutes": 90},
            {"start": "2025-03-03T02:00"}),
    Problem("event_lunch", 1, "Put 'Lunch with Sam' in my calendar for 2025-05-20 12:00, 60 minutes.",
            "create_event", {"title": "Lunch with Sam", "start": "2025-05-20T12:00", "duration_minutes": 60},
            {"title": "Lunch"}),
    Problem("event_planning", 3, "Set up a two-hour 'Quarterly planning' meeting on 2025-10-01 at 10:00 and invite "
            "carol@example.com, dan@example.com and eve@example.com.",
            "create_event", {"title": "Quarterly planning", "start": "2025-10-01T10:00", "duration_minutes": 120,
                             "attendees": ["carol@example.com", "dan@example.com", "eve@example.com"]},
            {"attendees": ["carol@example.com", "dan@example.com"]}),
    # send_email
    Problem("email_weekly_report", 2, "Email boss@example.com with the subject 'Weekly report' and the body "
            "'The report is attached.'",
            "send_email", {"to": ["boss@example.com"], "subject": "Weekly report", "body": "The report is attached."},
            {"subject": "Monthly report"}),
    Problem("email_deploy", 2, "Send an e-mail to ops@example.com and dev@example.com, subject 'Deploy done', "
            "saying 'Version 2.1 is live.'",
            "send_email", {"to": ["ops@example.com", "dev@example.com"], "subject": "Deploy done",
                           "body": "Version 2.1 is live."}, {"to": ["ops@example.com"]}),
    Problem("email_not_calendar", 3, "Tell tom@example.com by e-mail that the 3 pm meeting is cancelled: subject "
            "'Meeting cancelled', body 'The 3 pm meeting is cancelled.'",
            "send_email", {"to": ["tom@example.com"], "subject": "Meeting cancelled",
                           "body": "The 3 pm meeting is cancelled."},
            {"title": "Meeting cancelled", "start": "2025-01-01T15:00", "duration_minutes": 60}, wrong_name="create_event"),
]  # fmt: skip


def problems() -> list[Problem]:
    return list(_PROBLEMS)


def to_task(p: Problem, run_id: str, group_size: int, index: int) -> Task:
    messages = [ChatMessage(role="system", content=SYSTEM), ChatMessage(role="user", content=p.request)]
    return suite_task(SUITE, p, run_id, group_size, index, messages=messages, max_tokens=256,
                      verifier=VerifierSpec(kind="tool_call", data={"suite": SUITE, "expected": p.expected}))  # fmt: skip
