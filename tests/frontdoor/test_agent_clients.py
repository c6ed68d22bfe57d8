"""Real agent frameworks against the real `kvroute serve`: LangChain's ChatOpenAI and the OpenAI Agents SDK."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
from pydantic import BaseModel, Field
from served import Served


class Place(BaseModel):
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


def test_langchain_bind_tools_and_structured_output(served: Served) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, days: int) -> str:
        """The weather forecast for a city, for some days."""
        return "sunny"

    llm = ChatOpenAI(
        base_url=f"{served.url}/v1", api_key=served.api_key, model="default", temperature=0, max_tokens=60, max_retries=0
    )
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris for 3 days?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and isinstance(call["args"]["days"], int)
    assert call["id"]
    place = llm.with_structured_output(Place).invoke("Name a city and its country.")
    assert isinstance(place, Place) and place.city


def test_openai_agents_sdk_runs_a_tool_using_turn(served: Served) -> None:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[tuple[str, int]] = []

    @function_tool
    def get_weather(city: str, days: int) -> str:
        """The weather forecast for a city, for some days."""
        calls.append((city, days))
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=served.api_key, max_retries=0)
    agent = Agent(
        name="forecaster",
        instructions="Answer weather questions with the get_weather tool.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model="default", openai_client=client),
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60, parallel_tool_calls=False),
        tool_use_behavior="stop_on_first_tool",
    )

    async def run() -> Any:
        # Closed on its own loop: an SDK client left open closes itself when collected, on whatever loop runs then
        async with client:
            return await Runner.run(agent, "What is the weather in Paris for 3 days?", max_turns=2)

    result = asyncio.run(run())
    assert len(calls) == 1 and isinstance(calls[0][0], str) and isinstance(calls[0][1], int)
    assert result.final_output == f"sunny in {calls[0][0]}"
