"""openai-agents against kvserve's Responses API: an Agent whose first turn must call its function
tool (tool_choice required) runs the tool and answers from its result (the SDK reads each turn as
a stream of Responses events).
The model is small, so what is checked is the round trip, not the answer's wording."""

import asyncio

import pytest

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


def make_agent(server, cities):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # traces would be sent to OpenAI's servers

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return "Sunny, 24 C"

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = OpenAIResponsesModel(model=MODEL, openai_client=client)
    settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0.0, max_tokens=80)
    return Agent(name="weather", instructions="Answer questions about the weather.", tools=[get_weather],
                 model=model, model_settings=settings)


def assert_round_trip(result, cities):
    from agents.items import ToolCallItem, ToolCallOutputItem
    kinds = [type(item) for item in result.new_items]
    assert ToolCallItem in kinds and ToolCallOutputItem in kinds  # the call, then its result sent back
    assert cities and all(isinstance(c, str) and c for c in cities)
    assert isinstance(result.final_output, str) and result.final_output  # a second turn answered
    assert len(result.raw_responses) >= 2


def test_agent_calls_its_tool_and_answers(smollm2_server):
    from agents import Runner
    cities: list[str] = []
    result = asyncio.run(Runner.run(make_agent(smollm2_server, cities), "What is the weather in Paris?",
                                    max_turns=4))
    assert_round_trip(result, cities)
