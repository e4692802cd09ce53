// The Node `openai` SDK's agent: a streamed tool call, the tool's result, a final answer,
// then one Responses API call. Usage: node node_agent.mjs BASE_URL [ROLLOUT_ID]
// AGENT_MODEL and AGENT_MAX_TOKENS (greedy, bounded answers) are for a real vLLM.
import OpenAI from "openai";

const [baseURL, rollout] = process.argv.slice(2);
const model = process.env.AGENT_MODEL ?? "scripted";
const limit = process.env.AGENT_MAX_TOKENS ? Number(process.env.AGENT_MAX_TOKENS) : undefined;
const chatLimit = limit ? { max_tokens: limit, temperature: 0 } : {};
const responsesLimit = limit ? { max_output_tokens: limit, temperature: 0 } : {};
const defaultHeaders = rollout ? { "X-Rollout-Group": "compat", "X-Rollout-Id": rollout } : {};
const client = new OpenAI({ baseURL, apiKey: "unused", defaultHeaders });
const tools = [{
  type: "function",
  function: {
    name: "get_weather",
    description: "The current weather in a city.",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
}];
const messages = [{ role: "user", content: "What is the weather in Paris?" }];

const stream = client.chat.completions.stream({ model, messages, tools, ...chatLimit });
const first = (await stream.finalChatCompletion()).choices[0].message;
messages.push(first);
for (const call of first.tool_calls ?? []) {
  const { city } = JSON.parse(call.function.arguments);
  messages.push({ role: "tool", tool_call_id: call.id, content: `${city}: 21 degrees, sunny` });
}
const final = await client.chat.completions.create({ model, messages, tools, ...chatLimit });
const response = await client.responses.create({ model, input: "Say done.", ...responsesLimit });
console.log(JSON.stringify({
  calls: (first.tool_calls ?? []).map((c) => c.function.name),
  answer: final.choices[0].message.content,
  responses: response.output_text,
}));
